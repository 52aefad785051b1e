"""Bad output paths and the terminal explorer's errors, table-driven (issue 11, items 9 and 12): every `--json`,
`--save`, `--trace` that cannot be written, or would overwrite an input, ends before any work in exit 2 and one line on
stderr, never an internal error or a traceback, and leaves nothing behind; good outputs keep the user's umask; `run
--json -` puts only JSON on stdout; the terminal explorer survives a failing command with its choices intact."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lanefuse.engine.errors import UserError
from lanefuse.lane.cli.main import main
from lanefuse.lane.lower.files import check_output_path, write_atomic

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def _setup(d: Path) -> None:
    """The files the cases name: a folder, a plain file (under which nothing can be made), a user's step YAML, a saved
    plan and a spec that an output must not overwrite, a read-only file."""
    (d / "out").mkdir()
    (d / "afile").write_text("not a folder\n")
    (d / "step.yaml").write_text("# a user's step YAML\n")
    (d / "plan.json").write_text("{}\n")
    (d / "spec.txt").write_text("lane: cuda\n")
    (d / "model.step").write_text("# a model file\n")
    (d / "ro.json").write_text("{}\n")
    os.chmod(d / "ro.json", 0o444)


# (name, argv with {d} for the case's folder, what the one line says)
CASES = [
    ("plan --json a folder", ["plan", "--json", "{d}/out"], "is a folder"),
    ("plan --save a folder", ["plan", "--save", "{d}/out"], "is a folder"),
    ("plan --trace a folder", ["plan", "--trace", "{d}/out"], "is a folder"),
    ("run --json a folder", ["run", "--tokens", "1", "--json", "{d}/out"], "is a folder"),
    ("plan --json in a missing folder", ["plan", "--json", "{d}/nope/p.json"], "does not exist"),
    ("run --json in a missing folder", ["run", "--json", "{d}/nope/o.json"], "does not exist"),
    ("plan --save under a file", ["plan", "--save", "{d}/afile/p.json"], "is a file, not a folder"),
    ("plan --trace in /proc", ["plan", "--trace", "/proc/lanefuse-trace.json"], "cannot write in folder /proc"),
    ("plan --json a name ending in /", ["plan", "--json", "{d}/newdir/"], "names a folder"),
    ("plan --json empty", ["plan", "--json", ""], "give a file name"),
    ("plan --json MODEL (a step YAML)", ["plan", "--json", "{d}/step.yaml"], "must not be named .yaml"),
    ("plan --save a .yml", ["plan", "--save", "{d}/new.yml"], "must not be named .yaml"),
    ("run --json a step YAML", ["run", "--json", "{d}/step.yaml"], "must not be named .yaml"),
    ("plan --json MODEL itself", ["plan", "{d}/model.step", "--json", "{d}/model.step"], "is the MODEL file"),
    ("plan --json the --spec file", ["plan", "--spec", "{d}/spec.txt", "--json", "{d}/spec.txt"],
     "is the --spec file"),
    ("run --json the --plan file", ["run", "--plan", "{d}/plan.json", "--json", "{d}/plan.json"],
     "is the --plan file"),
    ("plan --save and --trace one file", ["plan", "--save", "{d}/a.json", "--trace", "{d}/./a.json"],
     "--save writes the same file"),
    ("plan --json - and --save -", ["plan", "--json", "-", "--save", "-"], "already writes to stdout"),
    ("plan --json read-only file", ["plan", "--json", "{d}/ro.json"], "read-only"),
]


@pytest.mark.parametrize("name,argv,expect", CASES, ids=[c[0] for c in CASES])
def test_a_bad_output_path_is_one_line_before_any_work(tmp_path, capsys, monkeypatch, name, argv, expect):
    if name.endswith("read-only file") and ROOT:
        pytest.skip("root writes a read-only file")
    _setup(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def no_work(*a, **k):
        raise AssertionError("the command started its work before checking its output paths")

    import lanefuse.lane.cli.source as source

    monkeypatch.setattr(source, "open_model", no_work)
    rc = main([a.format(d=tmp_path) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lanefuse: error: ") and expect in lines[0], err
    assert "Traceback" not in err and "internal error" not in err and out == ""
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing overwritten, no temporary file left


def test_the_table_is_big_and_names_unique():
    assert len(CASES) >= 19 and len({c[0] for c in CASES}) == len(CASES)


def test_json_needs_its_file_so_it_never_swallows_model(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--json"])
    assert e.value.code == 2 and "--json: expected one argument" in capsys.readouterr().err


def test_plan_json_to_stdout_then_model(tmp_path, capsys):
    rc = main(["plan", "--json", "-"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["launches"]  # stdout is one JSON document, nothing else


def test_good_outputs_are_written_with_the_umask(tmp_path, capsys):
    old = os.umask(0o027)
    try:
        rc = main(["plan", "--json", str(tmp_path / "p.json"), "--save", str(tmp_path / "plan.json"),
                   "--trace", str(tmp_path / "t.json")])
    finally:
        os.umask(old)
    assert rc == 0, capsys.readouterr().err
    for n in ("p.json", "plan.json", "t.json"):
        assert stat.S_IMODE((tmp_path / n).stat().st_mode) == 0o640, n  # 0666 & ~027, as `>` would make it
        json.loads((tmp_path / n).read_text())
    assert not list(tmp_path.glob(".lanefuse-*"))


def test_write_atomic_keeps_a_replaced_files_mode_and_writes_devices_in_place(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("old")
    os.chmod(p, 0o604)
    write_atomic(str(p), "new\n")
    assert p.read_text() == "new\n" and stat.S_IMODE(p.stat().st_mode) == 0o604
    write_atomic(os.devnull, "{}\n")  # replacing /dev/null with a file (as root could) would break the machine
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    check_output_path("-")
    with pytest.raises(UserError, match="is a folder"):
        write_atomic(str(tmp_path), "x")  # the explorer's `save DIR` reaches here


def test_run_json_dash_puts_only_json_on_stdout(capsys):
    rc = main(["run", "--prompt-ids", "1,2", "--tokens", "2", "--json", "-"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    d = json.loads(out)  # the whole of stdout parses
    assert d["prompt_ids"] == [1, 2] and len(d["generated_ids"]) == 2
    assert "generated ids:" in err and "generated ids:" not in out


# ---- the terminal explorer (item 12) -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def explorer():
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.explore.explorer import Explorer

    cfg, _ = demo_model()
    ex = Explorer(build_step(cfg, 1), model_name="demo")
    yield ex
    ex.close()


def _shell(ex, script: str) -> tuple[str, object]:
    from lanefuse.lane.explore.shell import Shell

    out = io.StringIO()
    sh = Shell(ex, io.StringIO(script), out)
    sh.run()
    return out.getvalue(), sh


def test_the_explorer_survives_save_to_a_folder_and_a_bug(explorer, tmp_path, monkeypatch):
    def boom(tensor):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(explorer, "why", boom)
    (tmp_path / "ro").mkdir()
    text, sh = _shell(explorer, f"hold gemv_norm_epilogue\nsave {tmp_path}\nwhy L0.q\nsave {tmp_path}/nope/s.yaml\n"
                                f"plan\nsave {tmp_path}/s.yaml\nrelease gemv_norm_epilogue\n")
    assert f"error: {tmp_path}: is a folder" in text
    assert "internal error: RuntimeError: boom second line (the session goes on" in text
    assert "does not exist" in text
    assert "Traceback" not in text
    assert re.search(r"held:\s+gemv_norm_epilogue", text)  # the session's choices survived the errors
    assert (tmp_path / "s.yaml").exists() and "gemv_norm_epilogue" in (tmp_path / "s.yaml").read_text()
    assert sh.failed  # a scripted session still exits 1


def test_the_explorer_cli_exits_1_not_70_after_a_failed_save(tmp_path, capsys):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", "explore"], input=f"save {tmp_path}\nplan\n",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "is a folder" in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr
    assert "plan (" in r.stdout  # the command after the failed one ran


@pytest.mark.parametrize("value", ["1e999", "nan", "inf", "-1", "0"])
def test_a_knob_must_be_a_positive_finite_number(value):
    r = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", "plan", "--knob", f"hbm_gbps={value}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "knob `hbm_gbps`" in r.stderr and "positive finite number" in r.stderr
