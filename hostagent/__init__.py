"""The host agent and the launcher: the processes each run asks for, on the host that has
room for them.

Beside the web app (it reads and writes the same database), not inside it: the launcher
(`launcher`, `run_dartboard`, with the `embedded_redis`, the `preflight` checks and the
main job's presets, `main_job`) starts the stack on one machine; the agent (`agent`,
`placement`) starts and stops each run's own processes and copies their logs to the
database (`log_ship`). `docs_reference` writes the docs'
generated reference pages from every layer, so it sits on top of them all.

The top layer: may import every other package; none imports it (pyproject.toml's
import-linter layers).
"""
