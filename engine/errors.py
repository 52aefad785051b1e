"""The one exception a user's mistake raises: the command prints its message as one line and exits non-zero."""


class UserError(Exception):
    """A mistake in what the user gave (a file, a rule, a model, a flag), said in words: what, where, what to do."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
