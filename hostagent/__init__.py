"""The host agent: the processes each run asks for, on the host that has room for them.

Beside the web app (it reads and writes the same database), not inside it: the launcher
starts the stack on one machine, the agent starts and stops each run's own processes.
"""
