"""Files a user hands over, opened one careful way: a model file (memory-mapped or read whole) must be a regular
file (a FIFO blocks its reader for ever, a device never ends), and every input is read up to a stated cap, so a
wrong path is one line naming the file and the cap, never a hang or a MemoryError."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lanefuse.engine.errors import UserError

MIB = 1 << 20
MAX_JSON = 64 * MIB  # a config.json or a safetensors index (the largest hub index is a few MiB)
MAX_YAML = 16 * MIB  # a rules, lane, spec or step YAML file
MAX_PROMPTS = 256 * MIB  # a --prompts file


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def regular(path: str | Path, what: str = "a file") -> int:
    """The size of `path`, a regular file (symlinks followed); anything else refused in one line naming it."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path}: cannot read {what}: it is {_kind(st.st_mode)}, not a regular file")
    return st.st_size


def read_capped(path: str | Path, cap: int, what: str, pipes: bool = False, source: str | None = None) -> bytes:
    """The bytes of `path`, at most `cap` of them (a larger file refused, the cap named); `what` names the input in
    messages, `source` the file (the path by default). With `pipes`, a FIFO or a device is read too (a shell's
    `<(command)`), up to the cap."""
    source = str(path) if source is None else source
    if not pipes:
        try:
            regular(path, what)
        except UserError as e:
            raise UserError(str(e).replace(str(path), source, 1)) from None
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError as e:
        raise UserError(f"{source}: cannot read ({e.strerror or e})") from None
    if len(data) > cap:
        raise UserError(f"{source}: more than {size_text(cap)}, the most lanefuse reads of {what}")
    return data


def size_text(n: int) -> str:
    """A byte count as a bound is stated: whole MiB where it is some, else bytes."""
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n:,} bytes"
