"""Subjects for code that does not implement the probe protocol itself; each runs only in the worker."""
