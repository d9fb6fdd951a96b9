"""WebSocket routes."""

from django.urls import path

from dartboard import consumers

websocket_urlpatterns = [
    path("ws/runs/<int:run_id>/", consumers.RunEventsConsumer.as_asgi()),
]
