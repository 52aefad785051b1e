"""The family registry (engine/front/family.py): FAMILIES found from the Family subclasses in engine/front/families/,
each architecture read by one family, the readers and the CLI asking it (no architecture named outside a family's
file), a refusal of an unknown architecture one line listing them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.family import Family, families, for_gguf, for_hf, gguf_arch

ROOT = Path(__file__).resolve().parents[1]


def test_families_are_found_from_the_subclasses_one_file_each():
    fams = families()
    assert set(fams) >= {"llama", "qwen", "mixtures", "gemma", "gptoss", "qwen3next", "deepseek", "olmo2"}
    for name, f in fams.items():
        assert issubclass(f, Family) and f.name == name and f.hf
        assert f.__module__ == f"lanefuse.engine.front.families.{f.__module__.rsplit('.', 1)[1]}"
    assert len({f.__module__ for f in fams.values()}) == len(fams)  # one family a file


def test_each_architecture_is_read_by_one_family():
    hf = [a for f in families().values() for a in f.hf]
    gguf = [a for f in families().values() for a in f.gguf]
    assert len(hf) == len(set(hf)) and len(gguf) == len(set(gguf))
    for f in families().values():
        for a in f.hf:
            assert for_hf(a, "config.json") is f
        for a in f.gguf:
            assert for_gguf(a, "m.gguf") is f


class _Cfg:
    def __init__(self, arch):
        self.arch = arch


def test_every_gguf_table_names_the_architecture_it_is_written_as():
    """The CLI's `{arch}.context_length` (lane/cli/source.py) from the tables: each table's transformers architecture
    (Mixtral's, written as llama with expert_count, too) back to its `general.architecture` — the hand map it replaces
    had drifted (no gemma2, gemma3 or qwen3next)."""
    seen = {}
    for f in families().values():
        for a, names in f.gguf.items():
            for n in (names, names.mixture):
                if n is not None:
                    seen.setdefault(n.hf_arch, a)
                    assert n.hf_arch in f.hf or any(n.hf_arch in g.hf for g in families().values())
    for hf, a in seen.items():
        assert gguf_arch(_Cfg(hf)) == a
    assert gguf_arch(_Cfg("MixtralForCausalLM")) == "llama"
    assert {"gemma2", "gemma3", "qwen3next"} <= set(seen.values())


@pytest.mark.parametrize("read,arch,what", [(for_hf, "FalconForCausalLM", "architecture `FalconForCausalLM`"),
                                            (for_gguf, "falcon", "`general.architecture` is `falcon`")])
def test_an_unknown_architecture_is_refused_in_one_line_listing_the_families(read, arch, what):
    with pytest.raises(UserError) as e:
        read(arch, "here")
    msg = str(e.value)
    assert msg.startswith(f"here: {what}") and "\n" not in msg
    for name, f in families().items():
        archs = list(f.gguf if read is for_gguf else f.hf)
        assert (f"{name}: {', '.join(archs)}" in msg) == bool(archs)  # a family reading no GGUF file is not listed


def test_no_architecture_is_named_outside_a_familys_file():
    """The four dispatch sites (the config.json and GGUF readers, the loader, the CLI's source) ask the registry: none
    names a transformers architecture or spells a GGUF one."""
    names = [a for f in families().values() for a in (*f.hf, *f.gguf)]
    for rel in ("engine/front/hfconfig.py", "engine/front/gguf.py", "engine/front/load.py", "lane/cli/source.py",
                "engine/front/family.py"):
        text = (ROOT / rel).read_text(encoding="utf-8")
        hits = [a for a in names if re.search(rf'"{re.escape(a)}"', text)]
        assert not hits, f"{rel} names {hits}"
