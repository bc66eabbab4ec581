"""The data package's one error type, in a module of its own so every reader can raise it (datasets.py
reads user files and calls prepared.py for speculators' prepared directories; both raise DataError)."""


class DataError(Exception):
    """The user's data cannot be used; the message is one line naming the file (and line)."""
