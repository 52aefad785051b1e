"""`lanefuse kernels`: the CUDA kernel modules the launch kinds compile, and their cubins built ahead of time
(--build DIR, kernels/prebuilt.py) for LANEFUSE_CUBINS to point the CuPy runner at."""

from __future__ import annotations

import os
from pathlib import Path

from lanefuse.engine.errors import UserError, clip, did_you_mean


def _chosen(names: list[str] | None) -> list[tuple[str, ...]] | None:
    """The modules `--module NAME ...` names (every one where none is given); an unknown name refused in one line."""
    from lanefuse.kernels.prebuilt import module_name, modules

    if not names:
        return None
    by_name = {module_name(s): s for s in modules()}
    out = []
    for n in names:
        if n not in by_name:
            raise UserError(f"--module {clip(n)}: no such kernel module{did_you_mean(n, by_name)} "
                            f"(`lanefuse kernels` lists them)")
        out.append(by_name[n])
    return out


def _folder(path: str) -> Path:
    """--build's folder: made if missing; refused in one line where it is a file or cannot be written."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"--build {path}: is a file; give a folder for the cubins (it is made if missing)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--build {path}: cannot make the folder ({e.strerror})") from None
    if not os.access(p, os.W_OK):
        raise UserError(f"--build {path}: the folder is not writable")
    return p


def _compiler(choice: str) -> str:
    from lanefuse.kernels.prebuilt import compiler_available

    if choice != "auto":
        if not compiler_available(choice):
            raise UserError(f"--compiler {choice}: not found ("
                            + ("nvcc is not on PATH" if choice == "nvcc" else "cuda-python's NVRTC bindings are not "
                               "installed: pip install 'lanefuse[nvrtc]'") + ")")
        return choice
    for c in ("nvcc", "nvrtc"):
        if compiler_available(c):
            return c
    raise UserError("no CUDA compiler to build the kernels with: nvcc is not on PATH and cuda-python's NVRTC "
                    "bindings are not installed (pip install 'lanefuse[nvrtc]')")


def kernels_command(args) -> int:
    from lanefuse.engine import flags
    from lanefuse.kernels.compile import find_cubin, source
    from lanefuse.kernels.prebuilt import build, module_name, modules

    only = _chosen(args.module)
    todo = only or modules()
    if not args.build:  # the list: each module, its source size, and whether a cubin for --arch is built
        where = flags.read("LANEFUSE_CUBINS")
        print(f"{len(todo)} kernel modules; cubins for {args.arch} "
              + (f"in LANEFUSE_CUBINS={where}" if where else "(LANEFUSE_CUBINS unset: compiled at run time)"))
        for stems in todo:
            src = source(stems)
            built = find_cubin(src, args.arch, where) is not None
            print(f"  {module_name(stems):60s} {len(src.splitlines()):6d} lines"
                  + (f"  {'built' if built else 'not built'}" if where else ""))
        return 0
    folder = _folder(args.build)
    compiler = _compiler(args.compiler)
    print(f"building {len(todo)} kernel modules for {args.arch} with {compiler}, {args.jobs} at a time, into "
          f"{folder}", flush=True)

    def said(b) -> None:
        state = (f"FAILED after {b.seconds:.1f} s" if b.error else
                 "already built" if b.seconds == 0 else f"{b.seconds:.1f} s")
        print(f"  {module_name(b.stems):60s} {state}" + ("" if b.error else f"  {b.bytes / 2**20:.1f} MiB"),
              flush=True)

    done = build(folder, args.arch, compiler, args.jobs, todo, force=args.force, progress=said)
    bad = [b for b in done if b.error]
    if bad:
        raise UserError(f"{len(bad)} of {len(done)} kernel modules did not compile for {args.arch} with {compiler}; "
                        f"{module_name(bad[0].stems)}: {bad[0].error.splitlines()[0]}", code=1)
    print(f"{len(done)} modules, {sum(b.bytes for b in done) / 2**20:.1f} MiB in {folder}; run with "
          f"LANEFUSE_CUBINS={folder}")
    return 0
