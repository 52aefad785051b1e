"""Every output the CLI writes is whole or not at all (issue 36): `plan --html DIR` makes every file of the report
in a fresh folder beside DIR and renames it into place, so a failure at any file leaves no report (and no temporary
folder) behind; a report over an existing folder replaces its files only after all are written."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("egglog", reason="the engine needs egglog")

from lanefuse.engine.front.demo import demo_model  # noqa: E402
from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.model import build_step  # noqa: E402
from lanefuse.lane.explore import report  # noqa: E402


@pytest.fixture(scope="module")
def ex():
    from lanefuse.lane.explore.explorer import Explorer

    cfg, _ = demo_model()
    return Explorer(build_step(cfg, 1), model_name="demo")


def test_a_report_is_written_whole(ex, tmp_path):
    d = tmp_path / "r"
    paths = report.write_report(ex, str(d))
    assert sorted(os.listdir(d)) == sorted(["index.html", report.DATA, *report.ASSETS])
    assert all(os.path.getsize(p) > 0 for p in paths)
    assert os.listdir(tmp_path) == ["r"]  # no temporary folder left
    assert oct(os.stat(d).st_mode & 0o777) != oct(0o700)  # the user's umask, not mkdtemp's


@pytest.mark.parametrize("fail_at", ["index.html", report.DATA, "app.css", "rename"])
def test_a_failure_at_any_file_leaves_no_report(ex, tmp_path, monkeypatch, fail_at):
    real_open, real_rename = open, os.rename

    def failing_open(path, *a, **kw):
        if str(path).endswith(os.sep + fail_at):
            raise OSError(28, "No space left on device")
        return real_open(path, *a, **kw)

    def failing_rename(a, b):
        raise OSError(28, "No space left on device")

    if fail_at == "rename":
        monkeypatch.setattr(os, "rename", failing_rename)
    else:
        monkeypatch.setattr("builtins.open", failing_open)
    d = tmp_path / "r"
    with pytest.raises(UserError, match=r"--html .*r: cannot write the report: No space left on device; nothing "
                                        r"written"):
        report.write_report(ex, str(d))
    assert os.listdir(tmp_path) == []  # neither the report nor the temporary folder


def test_an_existing_folder_keeps_its_old_report_when_writing_fails(ex, tmp_path, monkeypatch):
    d = tmp_path / "r"
    report.write_report(ex, str(d))
    (d / "notes.txt").write_text("mine")
    before = {n: (d / n).read_bytes() for n in os.listdir(d)}
    real_open = open

    def failing_open(path, *a, **kw):
        if str(path).endswith("app.js") and "lanefuse-report" in str(path):
            raise OSError(28, "No space left on device")
        return real_open(path, *a, **kw)

    monkeypatch.setattr("builtins.open", failing_open)
    with pytest.raises(UserError, match="nothing written"):
        report.write_report(ex, str(d))
    assert {n: (d / n).read_bytes() for n in os.listdir(d)} == before
    assert sorted(os.listdir(tmp_path)) == ["r"]
