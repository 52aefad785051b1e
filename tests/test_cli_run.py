"""`lanefuse run`'s stream (issue 37): the ids written as they come, or the text as it grows, a token that ends
mid-character held back until the next completes it, and the line closed at the end."""

from __future__ import annotations

import io

from lanefuse.lane.cli.commands import _Stream


class _Bytes:
    """A tokenizer whose ids are bytes (UTF-8 pieces): a character may span two ids."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_ids_stream_on_one_line():
    out = io.StringIO()
    s = _Stream(out)
    seen = []
    for t in (5, 17, 3):
        s.token(t)
        seen.append(out.getvalue())
    s.end()
    assert seen == ["generated ids: 5", "generated ids: 5,17", "generated ids: 5,17,3"]
    assert out.getvalue() == "generated ids: 5,17,3\n"


def test_text_grows_and_waits_for_a_whole_character():
    out = io.StringIO()
    s = _Stream(out, _Bytes())
    text = "a é b"
    seen = []
    for b in text.encode():
        s.token(b)
        seen.append(out.getvalue())
    s.end()
    assert out.getvalue() == f"text: {text}\n"
    assert "\ufffd" not in "".join(seen)  # the half of `é` was never written
    assert seen[1] == seen[2] == "text: a " and seen[3] == "text: a é"  # held one token, then both at once


def test_nothing_generated_writes_nothing():
    out = io.StringIO()
    _Stream(out).end()
    assert out.getvalue() == ""
