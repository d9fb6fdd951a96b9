"""Worker lifecycle: long-running loops (env slots, the trainer) end their current unit of
work and return when the worker is asked to shut down (Ctrl-C / SIGTERM of `make run`), so
a warm shutdown is quick and nothing is cut in the middle of a database write."""

import threading

shutdown_requested = threading.Event()
