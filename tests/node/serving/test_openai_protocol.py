"""node.serving.openai_protocol's TextStream: stop strings and partial UTF-8 held back, never leaked."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from node.serving.openai_protocol import TextStream


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


# -- issue 30: stop strings bounded in length, matched in linear time --------------------------
def test_a_stop_string_over_the_limit_is_a_400_naming_it_on_both_servers():
    """One limit for both servers (``node.engine.stop_text``); a 1 MB stop string is refused before
    anything is decoded, the message naming the limit."""
    import pytest

    from node.serving import turn_options
    from node.serving.openai_protocol import APIError, parse_chat, parse_completion
    from node.engine.stop_text import MAX_STOP_CHARS
    assert turn_options.MAX_STOP_CHARS is MAX_STOP_CHARS
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for stop in ("x" * (1 << 20), ["ok", "x" * (MAX_STOP_CHARS + 1)]):
        for parse, b in ((parse_chat, body), (parse_completion, {"model": "m", "prompt": "hi"})):
            with pytest.raises(APIError) as e:
                parse({**b, "stop": stop}, "m", 16)
            assert e.value.status == 400 and e.value.param == "stop"
            assert f"{MAX_STOP_CHARS} characters" in e.value.message
    assert parse_chat({**body, "stop": "x" * MAX_STOP_CHARS}, "m", 16).stop == ("x" * MAX_STOP_CHARS,)
    with pytest.raises(ValueError, match=f"{MAX_STOP_CHARS} characters"):
        TextStream(lambda ids: "", ["x" * (MAX_STOP_CHARS + 1)])  # no way around the parser


def test_text_stream_work_is_linear_in_the_reply():
    """The work measure, not a timing: ids decoded and characters searched grow linearly with
    the reply, whatever the stop strings (the old stream decoded every id at every token:
    n^2/2 ids, and its held-back search was quadratic in a stop string's length)."""
    from node.engine.stop_text import MAX_STOP_CHARS
    n = 3000
    decoded = [0]

    def decode(ids):
        decoded[0] += len(ids)
        return "a" * len(ids)
    worst = ["a" * (MAX_STOP_CHARS - 1) + b for b in "bcde"]  # the held tail is always 63 chars
    ts = TextStream(decode, worst)
    out = "".join(ts.push(97) for _ in range(n)) + ts.finish()
    assert out == "a" * n and not ts.stopped
    assert decoded[0] <= 4 * n
    assert ts.searched <= len(worst) * (MAX_STOP_CHARS + 1) * n


@settings(max_examples=150, deadline=None)
@given(text=st.text("ab日é\n", max_size=24),
       stops=st.lists(st.text("ab日\n", min_size=1, max_size=4), max_size=4))
def test_byte_stream_is_the_whole_decode_cut_at_the_first_stop(text, stops):
    """UTF-8 bytes as tokens (a character split over up to 3 tokens): the streamed text is the
    decode of all the ids, cut before the first stop string, and never shows a stop string."""
    ts = TextStream(lambda ids: bytes(ids).decode("utf-8", "replace"), stops)
    out = ""
    for b in text.encode():
        out += ts.push(b)
        assert "\ufffd" not in out and not any(s in out for s in stops)
        if ts.stopped:
            break
    out += ts.finish()
    data, want, cuts = text.encode(), text, []
    for k in range(1, len(data) + 1):  # the text settled after k bytes: whole characters
        settled = data[:k].decode("utf-8", "ignore")
        if cuts := [settled.find(s) for s in stops if s in settled]:
            want = settled[:min(cuts)]
            break
    assert out == want and ts.stopped == bool(cuts)
