"""JSON files a user hands over (config.json, a safetensors index), read with one error shape: not UTF-8, not
readable or not JSON, each a one-line UserError naming the file."""

from __future__ import annotations

import json
from pathlib import Path

from lanefuse.engine.errors import UserError


def read_json(path: str | Path, what: str):
    """The JSON document in `path`; `what` names the file's kind in messages (e.g. "config.json is JSON")."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text ({what})") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None
