"""The plan check (lane/lower/plancheck.py) over launches that read a column part of a wider array: a gated delta net's
convolutions read the q, k and v channels of each row of `qkvz` (its z channels unread), conv_parts in one launch,
the conservative lane's conv launches one a part. Every Qwen3-Next plan the planner makes passes the check saved and
loaded; a part that reads other values than its own (a wrong pitch, an offset past its row, rows past the tensor) is
still refused, naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("egglog")
transformers = pytest.importorskip("transformers")

from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.hfconfig import config_from_hf  # noqa: E402

PLANNED = [({}, 1), ({}, 4), ({}, 8), ({"numerics": "q8"}, 1), ({"numerics": "q8x2"}, 8),
           ({"lane": "conservative"}, 1), ({"lane": "conservative"}, 8), ({"held": ["conv_parts"]}, 4),
           ({"held": ["conv_silu_l2norm", "conv_bias_silu"]}, 1), ({"held": ["gemv_parts"]}, 4)]


def _config(kind: str):
    import gpu_families as gfm
    from test_qwen3next import BASE

    kw = BASE if kind == "tiny" else dict(gfm.FAMILIES["qwen3_next"][1], max_position_embeddings=128)
    c = json.loads(transformers.Qwen3NextConfig(**kw).to_json_string())
    c["architectures"] = ["Qwen3NextForCausalLM"]
    return config_from_hf({k: v for k, v in c.items() if v is not None})


def _plan(kind="tiny", rows=1, **kw):
    from lanefuse.lane.lower.plan import plan

    return plan(_config(kind).build_step(rows), **kw)


def _saved_and_loaded(p, tmp_path):
    from lanefuse.lane.lower.planfile import load, save

    f = tmp_path / "p.json"
    save(p, str(f))
    return load(str(f))  # decoded and checked


def _convs(p):
    return [x for x in p.launches if x.launch.census in ("conv", "conv_parts")]


@pytest.mark.parametrize("kind", ["tiny", "gpu_family"])
@pytest.mark.parametrize("kw,rows", PLANNED, ids=[f"{kw or 'cuda'}-{r}" for kw, r in PLANNED])
def test_every_qwen3_next_plan_passes_the_check(kind, kw, rows, tmp_path):
    p = _plan(kind, rows, **kw)
    convs = _convs(p)
    assert convs  # the convolutions read parts of qkvz: what the check once refused
    for x in convs:
        for part in (x.launch.parts if x.launch.census == "conv_parts" else (x.launch,)):
            assert part.xpitch > part.chan and p.buffers[part.x].size == rows * part.xpitch
    q = _saved_and_loaded(p, tmp_path)
    assert [x.launch for x in q.launches] == [x.launch for x in p.launches]


def _tampered(p, i, **change):
    """Plan `p` with launch `i`'s first convolution changed (conv_parts: its first part; conv: the launch)."""
    x = p.launches[i]
    l = x.launch
    if l.census == "conv_parts":
        l = dataclasses.replace(l, parts=(dataclasses.replace(l.parts[0], **change), *l.parts[1:]))
    else:
        l = dataclasses.replace(l, **change)
    launches = list(p.launches)
    launches[i] = dataclasses.replace(x, launch=l)
    return dataclasses.replace(p, launches=launches)


def _refused(p, tmp_path, where, message):
    with pytest.raises(UserError) as e:
        _saved_and_loaded(p, tmp_path)
    assert where in str(e.value) and message in str(e.value), str(e.value)


@pytest.mark.parametrize("lane", ["cuda", "conservative"])
def test_a_part_read_otherwise_than_its_rows_is_refused(lane, tmp_path):
    p1 = _plan(rows=1, lane=lane)
    p8 = _plan(rows=8, lane=lane)
    i = p1.launches.index(_convs(p1)[0])
    j = p8.launches.index(_convs(p8)[0])
    at = f"launches[{i}] ({p1.launches[i].launch.census})"
    x = "parts[0].x" if lane == "cuda" else "x"
    # a pitch of 256 over rows of 384: inside the tensor at one row, but every value after the first row another's
    _refused(_tampered(p1, i, xpitch=256), tmp_path, f"{at}.{x}", "values read but `L0.qkvz` holds 384")
    # a wider pitch at 8 rows: past the tensor's end
    at8 = f"launches[{j}] ({p8.launches[j].launch.census})"
    _refused(_tampered(p8, j, xpitch=512), tmp_path, f"{at8}.{x}", "reached but it holds 3072")
    # channels past the end of their row: the next row's first values (the kernel's own check)
    _refused(_tampered(p1, i, xoff=384 - 32), tmp_path, at, "refused: a convolution of channels 352..415 of rows of 384")
    # the plan's own, untouched, loads
    _saved_and_loaded(p1, tmp_path)
