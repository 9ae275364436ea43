"""The error a user can fix, :class:`ForensicsError`, in a module of its own: the command
line catches it around every command, and importing it must not import what the API
needs (DuckDB, polars, pyarrow: most of a second), or ``forensics --help`` would wait for
them. :mod:`forensics.api` re-exports it; ``forensics.api.ForensicsError`` is this class."""
from __future__ import annotations


class ForensicsError(Exception):
    """A problem the user can fix; the message says what it is, and what to do where that
    is not obvious. The command line prints it as one ``error:`` line and exits with
    status 2. The exception it stands for, if any, is its ``__cause__``."""
