"""Files written whole or not at all: every file lanefuse writes (a plan, a plan file, JSON output) goes through
`write_atomic`, so a failed run never leaves partial output behind; `check_output_path` refuses a path that cannot be
written before any work starts."""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile

from lanefuse.engine.errors import UserError


def _where(path: str, flag: str) -> str:
    return f"{flag} {path}" if flag else path


def check_output_path(path: str, flag: str = "") -> None:
    """Refuse, in one line naming `flag` and `path`, an output path lanefuse could not write: empty, a folder, in a
    folder that does not exist or is not writable, or a read-only file. `-` (stdout) always passes. A device or pipe
    that exists (`/dev/null`, a FIFO) passes: it is written in place."""
    where = _where(path, flag)
    if path == "-":
        return
    if not path:
        raise UserError(f"{flag or 'the output path'}: give a file name (or - for stdout)")
    if os.path.isdir(path):
        raise UserError(f"{where}: is a folder; give a file name inside it")
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):
        raise UserError(f"{where}: names a folder; give a file name")
    if os.path.exists(path):
        if not stat.S_ISREG(os.stat(path).st_mode):
            return  # a device or a pipe: written in place
        if not os.access(path, os.W_OK):
            raise UserError(f"{where}: the file is read-only; give another name or make it writable")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        up = next((a for a in _ancestors(d) if os.path.exists(a)), None)
        if up is not None and not os.path.isdir(up):
            raise UserError(f"{where}: {up} is a file, not a folder")
        raise UserError(f"{where}: folder {d} does not exist")
    try:  # the real test: a file can be made beside the target (a read-only file system fails here, not later)
        fd, probe = tempfile.mkstemp(dir=d, prefix=".lanefuse-", suffix=".probe")
    except OSError as e:
        raise UserError(f"{where}: cannot write in folder {d}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


def _ancestors(d: str):
    while True:
        yield d
        up = os.path.dirname(d)
        if up == d:
            return
        d = up


def _umask() -> int:
    """The process's umask, read without changing it where /proc says it (os.umask alone must set it to read it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    m = os.umask(0o022)
    os.umask(m)
    return m


def write_atomic(path: str, text) -> None:
    """Write `text` to `path` whole or not at all: a failed run never leaves partial output behind. A new file gets
    the user's umask (0666 & ~umask, as the shell's `>` would), a replaced file keeps its mode; `-` is stdout. `text`
    may be an iterable of str (a large output made a part at a time: into a file, streamed to its temporary copy;
    to stdout or a pipe, joined first, so a part that fails writes nothing there either)."""
    if not isinstance(text, str) and (path == "-" or (os.path.exists(path) and
                                                      not stat.S_ISREG(os.stat(path).st_mode))):
        text = "".join(text)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    check_output_path(path)
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        try:  # a device or a pipe: there is nothing to replace atomically
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise UserError(f"{path}: cannot write: {e.strerror or e}") from None
        return
    d = os.path.dirname(os.path.abspath(path))
    mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o666 & ~_umask()
    try:
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".lanefuse-", suffix=".tmp")
    except OSError as e:
        raise UserError(f"{path}: cannot write in folder {d}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text) if isinstance(text, str) else f.writelines(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise UserError(f"{path}: cannot write: {e.strerror or e}") from None
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
