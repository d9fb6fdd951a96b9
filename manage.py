#!/usr/bin/env python
"""Django's command-line utility for Dartboard."""

import os
import sys


def main() -> None:
    os.umask(0o077)  # what commands write under DARTBOARD_HOME (database, secrets) is private
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
