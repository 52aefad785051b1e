"""Kernel modules built ahead of time (kernels/prebuilt.py, `lanefuse kernels --build DIR`): a cubin under the module's
run-time cache key, written whole, loaded by kernels/compile.py where LANEFUSE_CUBINS names its folder (never a cubin
of another source), and the command's refusals in one line. The compiles here are the smallest module's (argmax,
about a second)."""

from __future__ import annotations

import re
import sys
import types

import pytest

from lanefuse.kernels import compile as kc
from lanefuse.kernels import prebuilt
from lanefuse.lane.cli.main import main

SMALL = ("argmax",)
EM_CUDA = 190  # ELF e_machine of a CUDA cubin


def kernel_names(src: str) -> list[str]:
    return re.findall(r'extern\s+"C"\s+__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s+)?(?:void\s+)?(\w+)\s*\(',
                      src)


@pytest.mark.parametrize("compiler", ["nvcc", "nvrtc"])
def test_a_module_is_built_to_a_cubin_under_its_run_time_key(tmp_path, compiler):
    if not prebuilt.compiler_available(compiler):
        pytest.skip(f"{compiler} is not here")
    b = prebuilt.build_one(SMALL, "sm_90", tmp_path, compiler)
    assert not b.error, b.error
    src = kc.source(SMALL)
    assert b.path == tmp_path / f"{kc.cache_key(src, 'sm_90')}.cubin" == tmp_path / prebuilt.cubin_name(SMALL, "sm_90")
    blob = b.path.read_bytes()
    assert blob[:4] == b"\x7fELF" and int.from_bytes(blob[18:20], "little") == EM_CUDA
    names = kernel_names(src)
    assert names and all(n.encode() in blob for n in names), names
    assert [p.name for p in tmp_path.iterdir()] == [b.path.name]  # nothing else left: the temporary file renamed
    again = prebuilt.build_one(SMALL, "sm_90", tmp_path, compiler)
    assert again.seconds == 0 and again.path == b.path  # there already: not compiled again


def test_a_module_that_does_not_compile_leaves_no_file(tmp_path, monkeypatch):
    compiler = next((c for c in ("nvcc", "nvrtc") if prebuilt.compiler_available(c)), None)
    if compiler is None:
        pytest.skip("neither nvcc nor NVRTC is here")
    monkeypatch.setattr(prebuilt, "source", lambda stems: "extern \"C\" __global__ void k() { not c++ }\n")
    b = prebuilt.build_one(SMALL, "sm_90", tmp_path, compiler)
    assert b.error and b.bytes == 0
    assert list(tmp_path.iterdir()) == []


class FakeCupy(types.ModuleType):
    """CuPy as kernels/compile.py uses it: the device's compute capability and RawModule, recorded."""

    def __init__(self):
        super().__init__("cupy")
        self.made = []
        fake = self

        class Device:
            compute_capability = "90"

        class RawModule:
            def __init__(self, **kw):
                fake.made.append(kw)

        self.cuda = types.SimpleNamespace(Device=Device)
        self.RawModule = RawModule


@pytest.fixture
def cupy(monkeypatch):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(kc, "_MODULES", {})
    return fake


def test_the_runner_loads_the_prebuilt_cubin_of_its_source_and_arch(tmp_path, cupy, monkeypatch):
    src = kc.source(SMALL)
    cubin = tmp_path / f"{kc.cache_key(src, 'sm_90')}.cubin"
    cubin.write_bytes(b"\x7fELF")
    monkeypatch.setenv("LANEFUSE_CUBINS", str(tmp_path))
    kc.module(SMALL)
    assert cupy.made == [dict(path=str(cubin))]
    kc.module(("quant",))  # no cubin of this module there: compiled from its source, as without the folder
    assert cupy.made[1] == dict(code=kc.source(("quant",)), options=kc.OPTIONS, name_expressions=None)


def test_a_cubin_of_another_source_or_arch_is_never_taken(tmp_path, cupy, monkeypatch):
    src = kc.source(SMALL)
    (tmp_path / f"{kc.cache_key(src + '// older', 'sm_90')}.cubin").write_bytes(b"\x7fELF")
    (tmp_path / f"{kc.cache_key(src, 'sm_80')}.cubin").write_bytes(b"\x7fELF")
    monkeypatch.setenv("LANEFUSE_CUBINS", str(tmp_path))
    kc.module(SMALL)
    assert cupy.made == [dict(code=src, options=kc.OPTIONS, name_expressions=None)]


def test_without_the_flag_every_module_compiles_at_run_time(tmp_path, cupy, monkeypatch):
    (tmp_path / prebuilt.cubin_name(SMALL, "sm_90")).write_bytes(b"\x7fELF")
    monkeypatch.delenv("LANEFUSE_CUBINS", raising=False)
    kc.module(SMALL)
    assert "code" in cupy.made[0]


def test_every_launch_kind_module_is_listed(capsys):
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    mods = prebuilt.modules()
    assert out.splitlines()[0].startswith(f"{len(mods)} kernel modules")
    assert [line.split()[0] for line in out.splitlines()[1:]] == [prebuilt.module_name(s) for s in mods]
    assert any("chain" in s for s in mods) and any("gemv" in s for s in mods)


def test_the_command_builds_then_finds_the_cubins(tmp_path, capsys, monkeypatch):
    if not any(prebuilt.compiler_available(c) for c in ("nvcc", "nvrtc")):
        pytest.skip("neither nvcc nor NVRTC is here")
    d = tmp_path / "cubins"
    assert main(["kernels", "--build", str(d), "--module", "argmax", "-j", "1"]) == 0
    out = capsys.readouterr().out
    assert "argmax" in out and f"LANEFUSE_CUBINS={d}" in out
    assert (d / prebuilt.cubin_name(SMALL, "sm_90")).is_file()
    assert main(["kernels", "--build", str(d), "--module", "argmax"]) == 0
    assert "already built" in capsys.readouterr().out
    monkeypatch.setenv("LANEFUSE_CUBINS", str(d))
    assert main(["kernels", "--module", "argmax", "--module", "quant"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "argmax" and lines[1].endswith(" built")
    assert lines[2].split()[0] == "quant" and lines[2].endswith("not built")


@pytest.mark.parametrize("argv, said", [
    (["--module", "argmaxx"], "--module argmaxx: no such kernel module (did you mean `argmax`?)"),
    (["--build", "FILE"], "is a file; give a folder for the cubins"),
    (["--build", "DIR", "--compiler", "nvcc"], None),  # refused only where nvcc is missing (below)
])
def test_refusals_are_one_line(tmp_path, capsys, monkeypatch, argv, said):
    f = tmp_path / "f"
    f.write_text("x")
    argv = [str(f) if a == "FILE" else str(tmp_path / "d") if a == "DIR" else a for a in argv]
    if said is None:
        monkeypatch.setattr(prebuilt.shutil, "which", lambda name: None)
        monkeypatch.setattr(prebuilt, "build", lambda *a, **k: pytest.fail("built without a compiler"))
        said = "--compiler nvcc: not found (nvcc is not on PATH)"
    assert main(["kernels", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err


def test_a_failed_compile_ends_in_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    compiler = next((c for c in ("nvcc", "nvrtc") if prebuilt.compiler_available(c)), None)
    if compiler is None:
        pytest.skip("neither nvcc nor NVRTC is here")
    monkeypatch.setattr(prebuilt, "source", lambda stems: "this is not CUDA\n")
    assert main(["kernels", "--build", str(tmp_path), "--module", "argmax", "--compiler", compiler]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lanefuse: error: 1 of 1 kernel modules did not compile")
    assert "argmax" in err and not list(tmp_path.glob("*.cubin"))


@pytest.mark.parametrize("argv", [["--jobs", "0"], ["--arch", "sm_70"], ["--compiler", "clang"]])
def test_absurd_arguments_are_refused_by_the_parser(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["kernels", *argv])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage, then its one error line
    assert last.startswith("lanefuse kernels: error: argument") and argv[0] in last, last
