"""The target package's one error type, in a module of its own: the embedded target's builder and the
frozen target's loader both raise it, and the loader calls the builder."""


class TargetError(Exception):
    """The target cannot be used; the message is one line saying why and what to do."""
