"""Files written whole or not at all: every file lanefuse writes (a plan, a plan file, JSON output) goes through
`write_atomic`, so a failed run never leaves partial output behind."""

from __future__ import annotations

import json
import os
import sys
import tempfile

from lanefuse.engine.errors import UserError


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` whole or not at all: a failed run never leaves partial output behind."""
    if path == "-":
        sys.stdout.write(text)
        return
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise UserError(f"{path}: folder {d} does not exist")
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".lanefuse-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def json_text(obj, what: str, **kw) -> str:
    """`obj` as JSON text (a newline at its end), NaN and inf refused in words: JSON has no such numbers, and a
    bare `NaN` would be read by no strict parser. `what` names the output in the refusal."""
    try:
        return json.dumps(obj, allow_nan=False, **kw) + "\n"
    except ValueError:
        raise UserError(f"{what}: not written: it would hold a non-finite number (NaN or inf), which JSON cannot "
                        f"hold") from None
