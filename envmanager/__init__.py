"""Environment cluster: GUI environments behind one protocol, env slots, their Celery tasks."""
