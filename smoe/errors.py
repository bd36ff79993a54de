"""The one exception type users see: the CLI prints its message on one line and exits 2."""


class SmoeError(Exception):
    """A user-facing error: bad input, missing files, unknown model family, corrupt vault."""
