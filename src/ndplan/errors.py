"""The one error type users see: a bad input, told in one line."""


class NdplanError(ValueError):
    """A problem with the user's input. The CLI prints its message on one line and exits 2."""
