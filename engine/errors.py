"""The one exception a user's mistake raises: the command prints its message as one line and exits non-zero."""


class UserError(Exception):
    """A mistake in what the user gave (a file, a rule, a model, a flag), said in words: what, where, what to do."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def did_you_mean(name: str, known) -> str:
    """` (did you mean `x`?)` for the nearest known name, or nothing."""
    import difflib

    m = difflib.get_close_matches(str(name)[:200], [str(k) for k in known], n=1)  # a long name: its start
    return f" (did you mean `{m[0]}`?)" if m else ""


def clip(text, width: int = 60) -> str:
    """Text from the user (a name, a value, a line of a file) as a message may echo it: itself where printable, else
    its repr, cut to `width` characters with its length said, so a message stays a line whatever the input's size."""
    t = str(text)
    t = t if t.isprintable() else repr(t)
    return t if len(t) <= width else f"{t[: max(width - 20, 8)]}... ({len(t)} characters)"


def listed(names, n: int = 8) -> str:
    """Known names as a message lists them: the first `n` in order, then how many there are in all."""
    names = [str(k) for k in names]
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def one_line(message, run: int = 300, most: int = 2000) -> str:
    """A message as it is printed: on one line, each unbroken run of more than `run` characters (an echoed name, a
    value, a line of a file) cut to its start and its length, the whole at most `most`: the last guard, for an echo
    no `clip` reached."""
    import re

    text = " ".join(str(message).split())
    text = re.sub(r"\S{%d,}" % (run + 1), lambda m: f"{m.group()[: run - 40]}... ({len(m.group())} characters)", text)
    return text if len(text) <= most else text[: most - 30] + f"... ({len(text)} characters)"
