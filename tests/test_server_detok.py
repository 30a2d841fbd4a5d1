"""Incremental detokenization and stop strings (no server), on the tiny model's byte tokenizer."""

from __future__ import annotations

import pytest

from akv_jax.model.tokenizer import ChatTokenizer
from akv_jax.serving.detok import TextStream

TOK = ChatTokenizer.byte_level_chatml(512)


def stream(text_ids: list[int], stop=()) -> tuple[list[str], TextStream]:
    ts = TextStream(TOK, stop)
    pieces = [ts.push(t) for t in text_ids]
    pieces.append(ts.finish())
    return pieces, ts


def test_multibyte_characters_are_never_split():
    ids = TOK.encode("añ€😀b")
    assert len(ids) == 1 + 2 + 3 + 4 + 1  # one id per byte
    pieces, ts = stream(ids)
    assert "".join(pieces) == ts.text == "añ€😀b"
    assert "\ufffd" not in "".join(pieces)
    # each character appears exactly when its last byte arrives
    assert [p for p in pieces if p] == ["a", "ñ", "€", "😀", "b"]


def test_special_tokens_are_skipped():
    ids = [*TOK.encode("hi"), TOK.token_to_id("<|im_end|>")]
    pieces, ts = stream(ids)
    assert ts.text == "hi"


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("hello world", ["wor"], "hello "),
        ("hello world", ["xyz"], "hello world"),
        ("hello world", ["o w", "ll"], "he"),  # earliest match wins
        ("abcabd", ["abd"], "abc"),  # a partial match that failed, then a real one
        ("ends with stop", ["stop"], "ends with "),
        ("€uro", ["€"], ""),
    ],
)
def test_stop_strings(text, stop, expected):
    pieces, ts = stream(TOK.encode(text), stop)
    assert "".join(pieces) == expected
    assert ts.text == expected
    assert ts.stopped == (expected != text)


def test_stop_prefix_is_held_back_until_resolved():
    ts = TextStream(TOK, ["END"])
    out = [ts.push(t) for t in TOK.encode("abEN")]
    assert "".join(out) == "ab"  # "EN" could start "END": not sent yet
    assert ts.push(TOK.encode("x")[0]) == "ENx"  # it did not
    assert ts.push(TOK.encode("E")[0]) == ""
    ts.push(TOK.encode("N")[0])
    assert ts.push(TOK.encode("D")[0]) == ""
    assert ts.stopped and ts.text == "abENx"
    assert ts.push(TOK.encode("z")[0]) == "" and ts.finish() == ""


def test_held_back_prefix_is_released_at_the_end():
    pieces, ts = stream(TOK.encode("abEN"), ["END"])
    assert pieces[-1] == "EN" and "".join(pieces) == "abEN" and not ts.stopped
