"""Errors shared by every component."""


class UsageError(Exception):
    """Bad input the user can fix: printed without a traceback, CLI exit code 2.

    The message must say what was wrong, with the offending value, and what to do.
    """
