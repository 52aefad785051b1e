"""The environment flags lanefuse reads, declared once: name, default, what it does. They are read at call
boundaries (the command's entry, a planning session, a test's setup), never in a hot loop; `read(name)` gives a
flag's value, parsed as its declaration says. The README lists them from here."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    name: str
    default: str
    kind: str  # int, path list (os.pathsep-separated), path, choice
    what: str


FLAGS = {f.name: f for f in (
    Flag("LANEFUSE_DEBUG", "0", "int", "1: an internal error shows its traceback; 2: the engine prints each rule's "
                                       "matches per plan"),
    Flag("LANEFUSE_CHECK", "0", "int", "2: `lanefuse run` on the numpy backend runs the reference interpreter beside "
                                       "the plan and names the first launch that diverges"),
    Flag("LANEFUSE_RULES", "", "path list", "rule folders added to the table, as with --rules (separated by "
                                            f"`{os.pathsep}`)"),
    Flag("LANEFUSE_PLANS", "", "path", "tests and bench/gpu_decode.py: the folder of saved plans the GPU suite runs"),
    Flag("LANEFUSE_SCREENSHOTS", "", "path", "tests: where the browser tests leave their screenshots"),
    Flag("LANEFUSE_MODEL_CACHE", "", "path", "bench/launch_model.py: where it keeps each kernel source's ptxas "
                                             "resources (default ~/.cache/lanefuse-launch-model)"),
    Flag("LANEFUSE_EMU_FULL", "0", "int", "tests: 1 replays the GPU tests' GEMV-family and attention cases at their "
                                          "own sizes on the host CUDA emulator (~10 min)"),
    Flag("LANEFUSE_EMU_CACHE", "", "path", "tests: where the host CUDA emulator keeps its compiled kernel modules "
                                           "(default a folder under the temp dir)"),
    Flag("LANEFUSE_CUBINS", "", "path", "a folder of kernel modules compiled ahead of time (`lanefuse kernels --build "
                                        "DIR`): the CuPy runner loads a module's cubin from it instead of compiling it"),
    Flag("LANEFUSE_PDL", "0", "int", "1: the CuPy runner launches every kernel with programmatic dependent launch "
                                     "(sm_90+; kernels/pdl.py): each may start while the one before it drains"),
    Flag("LANEFUSE_LLAMACPP_SRC", "", "path", "tests: a llama.cpp source tree (convert_hf_to_gguf.py, conversion/, "
                                              "gguf-py/) whose converter writes the GGUF files tests/test_gguf_converter.py reads"),
)}


def read(name: str, environ=None):
    """Flag `name`'s value: an int, a list of paths, or a string (the default where it is unset or empty)."""
    f = FLAGS[name]
    raw = (os.environ if environ is None else environ).get(name, "") or f.default
    if f.kind == "int":
        try:
            return int(raw)
        except ValueError:
            return int(f.default)
    if f.kind == "path list":
        return [p for p in raw.split(os.pathsep) if p]
    return raw


def table() -> list[tuple[str, str, str]]:
    """(name, default, what it does) of every flag, for the README and `--help`."""
    return [(f.name, f.default or "unset", f.what) for f in FLAGS.values()]
