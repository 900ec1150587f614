"""node.openai_protocol's TextStream: stop strings and partial UTF-8 held back, never leaked."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from node.openai_protocol import TextStream


def test_text_stream_holds_back_stop_prefixes_and_partial_utf8():
    pieces = ["Hel", "lo W", "or", "ld"]
    ts = TextStream(lambda ids: "".join(pieces[i] for i in ids), ["o Wor"])
    assert [ts.push(i) for i in range(3)] == ["Hel", "l", ""] and ts.stopped
    utf8 = TextStream(lambda ids: bytes(ids).decode("utf-8", "replace"))
    assert [utf8.push(b) for b in "a日".encode()] == ["a", "", "", "日"]
    assert utf8.finish() == ""


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.text("abc", max_size=3), min_size=1, max_size=12),
       stops=st.lists(st.text("abc", min_size=1, max_size=3), max_size=4))
def test_text_stream_equals_cutting_at_the_first_completed_stop(pieces, stops):
    """Streamed deltas never show a stop string, and add up to the text cut where the first
    stop string is complete (what a non-streamed reply of the same tokens holds)."""
    ts = TextStream(lambda ids: "".join(pieces[i] for i in ids), stops)
    out = ""
    for i in range(len(pieces)):
        out += ts.push(i)
        assert not any(s in out for s in stops)
        if ts.stopped:
            break
    out += ts.finish()
    want = "".join(pieces)
    for k in range(1, len(pieces) + 1):
        text = "".join(pieces[:k])
        if cuts := [text.find(s) for s in stops if s in text]:
            want = text[:min(cuts)]
            break
    assert out == want and ts.stopped == bool(cuts)
