"""ASGI entry point: HTTP through Django, WebSockets through Channels (login required).

Run: `python -m dartboard.serve --host 127.0.0.1 --port 8000` (uvicorn; serve.py says why).
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs the app registry)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from dartboard.body_limit import BodyLimit  # noqa: E402
from dartboard.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # Body limits while the body streams in, before Django spools it (body_limit.py).
        "http": BodyLimit(ASGIStaticFilesHandler(django_asgi_app)),
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        ),
    }
)
