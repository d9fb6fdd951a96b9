"""Dartboard's API client: the `dartboard` command (`cli`) and, for scripts and notebooks,
`Client` (`client`), a thin layer over the REST API that imports nothing of the server.

    from dartboard_client import Client
    client = Client()  # DARTBOARD_URL and DARTBOARD_TOKEN, or ~/.config/dartboard/client.yaml
    client.metrics_frame(12)  # run 12's greedy success per version (pandas, if installed)
"""

from dartboard_client.client import Client, DartboardError, Settings

__all__ = ["Client", "DartboardError", "Settings"]
