"""JSON files a user hands over (config.json, a safetensors index), read with one error shape: not UTF-8, not
readable or not JSON, each a one-line UserError naming the file."""

from __future__ import annotations

import json
from pathlib import Path

from lanefuse.engine.errors import UserError, clip
from lanefuse.engine.userfile import read_capped


def read_json(path: str | Path, what: str):
    """The JSON document in `path`; `what` names the file's kind in messages (e.g. "config.json is JSON")."""
    from lanefuse.engine import userfile

    data = read_capped(path, userfile.MAX_JSON, "a JSON file")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text ({what})") from None
    except RecursionError:
        raise UserError(f"{path}: not readable JSON (nested deeper than Python's parser goes)") from None
    except ValueError as e:  # not JSON, or an integer of more digits than Python converts
        raise UserError(f"{path}: not readable JSON ({clip(e, 160)})") from None
