"""The whole-array request checks (``validate_segments``) and the orjson body parser
(``parse_json_body``) against the per-token walk and the ``json.loads`` parser they replace:
same values, same errors (field and message), for random requests good and bad."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from akv_jax.cache.ops import CacheOpError, token_outside_vocab, validate_segments
from akv_jax.errors import InvalidField
from akv_jax.serving import protocol
from akv_jax.serving.protocol import Limits

LIMITS = Limits(max_body_bytes=1 << 24)


# --------------------------------------------------------------------------- oracles


def walk_segments(segments: Any, field: str = "input_ids", vocab_size: int | None = None):
    """``validate_segments`` as it was: the per-token walk, lists out."""
    if not isinstance(segments, Sequence) or isinstance(segments, (str, bytes)) or not segments:
        raise CacheOpError(field, "expected a non-empty list of token-id lists")
    if all(not isinstance(x, Sequence) for x in segments):
        segments = [segments]
    out: list[list[int]] = []
    for i, seg in enumerate(segments):
        f = f"{field}[{i}]"
        if not isinstance(seg, Sequence) or isinstance(seg, (str, bytes)):
            raise CacheOpError(f, "expected a list of token ids")
        if len(seg) == 0:
            raise CacheOpError(f, "empty segment")
        ids = []
        for j, t in enumerate(seg):
            if isinstance(t, bool) or not isinstance(t, int):
                raise CacheOpError(f"{f}[{j}]", f"expected an integer token id, got {t!r}")
            if (why := token_outside_vocab(t, vocab_size)) is not None:
                raise CacheOpError(f"{f}[{j}]", why)
            ids.append(t)
        out.append(ids)
    return out


def outcome(fn, *args) -> tuple:
    """("ok", value) or ("err", error class, field, message)."""
    try:
        return ("ok", fn(*args))
    except InvalidField as e:
        return ("err", type(e), e.field, e.message)


def as_lists(out: tuple) -> tuple:
    if out[0] == "ok":
        for a in out[1]:
            assert isinstance(a, np.ndarray) and a.dtype == np.int32 and a.ndim == 1
        return ("ok", [a.tolist() for a in out[1]])
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number",
          bool: "a boolean", type(None): "null"}


def json_body(raw: bytes) -> Any:
    """``parse_json_body`` as it was (after the size check): ``json.loads``."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidField("body", f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidField("body", f"expected a JSON object, got {_KINDS[type(body)]}")
    return body


def same_json(a: Any, b: Any) -> bool:
    """Equal with the same types throughout (1 is not 1.0, -0.0 is not 0.0), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a)
                                                      == math.copysign(1, b))
    return a == b


# --------------------------------------------------------------------------- validate_segments


def random_segments(rng: np.random.Generator, vocab: int) -> list[list[int]]:
    n = int(rng.integers(1, 9))
    return [rng.integers(0, vocab, int(rng.integers(1, 40))).tolist() for _ in range(n)]


def test_valid_segments_come_back_as_int32_arrays():
    rng = np.random.default_rng(0)
    for trial in range(300):
        vocab = int(rng.choice([1, 2, 512, 151_936, 2**31]))
        segs = random_segments(rng, vocab)
        if trial % 3 == 1:
            segs = [tuple(s) for s in segs]
        voc = vocab if trial % 4 else None
        assert as_lists(outcome(validate_segments, segs, "input_ids", voc)) == (
            "ok", [list(s) for s in segs])
        flat = segs[0]  # a flat list of ints is one segment
        assert as_lists(outcome(validate_segments, flat, "input_ids", voc)) == (
            "ok", [list(flat)])
    top = [[0, 2**31 - 1]]
    assert as_lists(outcome(validate_segments, top, "input_ids", None)) == ("ok", top)


BAD_TOKENS = [True, False, 1.0, 0.0, "7", None, [3], -1, -(2**63) - 1, -(2**70),
              "vocab", "vocab+1", 2**62, 2**63, 2**63 + 5, 2**64, 2**64 + 1, 2**100]


def bad_token(rng: np.random.Generator, vocab: int) -> Any:
    t = BAD_TOKENS[int(rng.integers(len(BAD_TOKENS)))]
    return {"vocab": vocab, "vocab+1": vocab + 1}.get(t, t) if isinstance(t, str) else t


def test_bad_tokens_give_the_walks_error():
    rng = np.random.default_rng(1)
    for trial in range(2000):
        vocab = int(rng.choice([1, 7, 512, 151_936]))
        segs = random_segments(rng, vocab)
        for _ in range(int(rng.integers(1, 4))):  # the first bad one, in order, is named
            s = int(rng.integers(len(segs)))
            segs[s][int(rng.integers(len(segs[s])))] = bad_token(rng, vocab)
        if trial % 5 == 0:  # a structural problem too, before or after the bad tokens
            segs.insert(int(rng.integers(len(segs) + 1)), [] if trial % 2 else 5)
        if trial % 7 == 0 and len(segs) == 1 and isinstance(segs[0], list):
            segs = segs[0]  # flat
        want = outcome(walk_segments, segs, "input_ids", vocab)
        assert want[0] == "err"
        assert outcome(validate_segments, segs, "input_ids", vocab) == want, segs


def test_structural_errors_unchanged():
    for segs in ([], (), "abc", b"ab", 5, None, {"a": 1}, [[1], []], [[]], [[1], "ab"],
                 [[1], b"ab"], [[1], 3], [1, [2]], [[1], {"a": 1}], [[1], None]):
        want = outcome(walk_segments, segs, "input_ids", 10)
        assert want[0] == "err"
        assert outcome(validate_segments, segs, "input_ids", 10) == want, segs


def test_no_vocabulary_still_int32():
    # The walk accepted any non-negative id with no vocabulary; ids now leave as int32.
    for t in (2**31, 2**40, 2**63, 2**64 + 3):
        got = outcome(validate_segments, [[1, 2], [3, t]], "input_ids", None)
        assert got == ("err", CacheOpError, "input_ids[1][1]",
                       f"token id {t} outside the vocabulary")
    # other problems are unchanged
    for segs in ([[1, -1]], [[1, True]], [[1.5]], [[1], []]):
        assert (outcome(validate_segments, segs, "input_ids", None)
                == outcome(walk_segments, segs, "input_ids", None))


def test_int_subclasses_still_accepted():
    class Tok(int):
        pass

    segs = [[Tok(3), 4], [5]]
    assert as_lists(outcome(validate_segments, segs, "input_ids", 10)) == (
        "ok", [[3, 4], [5]])


def test_numpy_segments():
    a = np.array([1, 2, 3], np.int32)
    out = validate_segments([a, [4]], "input_ids", 10)
    assert out[0] is a  # already int32: no copy
    assert [x.tolist() for x in out] == [[1, 2, 3], [4]]
    # what validate_segments returns passes again (admission re-checks engine requests)
    again = validate_segments(out, "input_ids", 10)
    assert all(x is y for x, y in zip(again, out, strict=True))
    for dtype in (np.int8, np.int16, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
        segs = [np.array([0, 5], dtype), np.array([9], dtype)]
        assert as_lists(outcome(validate_segments, segs, "input_ids", 10)) == (
            "ok", [[0, 5], [9]])
    rng = np.random.default_rng(2)
    for _ in range(300):  # an array's errors are those of its tokens as a list
        vocab = int(rng.choice([7, 512]))
        segs = random_segments(rng, vocab)
        s = int(rng.integers(len(segs)))
        j = int(rng.integers(len(segs[s])))
        segs[s][j] = int(rng.choice([-1, vocab, vocab + 3, 2**40]))
        arrays = [np.array(x, np.int64) for x in segs]
        assert (outcome(validate_segments, arrays, "input_ids", vocab)
                == outcome(walk_segments, segs, "input_ids", vocab))
    big = np.array([1, 2**63 + 5], np.uint64)
    assert outcome(validate_segments, [big], "input_ids", None) == (
        "err", CacheOpError, "input_ids[0][1]", f"token id {2**63 + 5} outside the vocabulary")
    for arr, field, words in [
        (np.array([1.0, 2.0]), "input_ids[0][0]", "expected an integer token id, got 1.0"),
        (np.array([True]), "input_ids[0][0]", "expected an integer token id, got True"),
        (np.zeros((2, 2), np.int32), "input_ids[0]", "expected a list of token ids"),
        (np.array(3, np.int32), "input_ids[0]", "expected a list of token ids"),
        (np.zeros(0, np.int32), "input_ids[0]", "empty segment"),
    ]:
        assert outcome(validate_segments, [arr, [1]], "input_ids", 10) == (
            "err", CacheOpError, field, words)


# --------------------------------------------------------------------------- parse_json_body


def random_value(rng: np.random.Generator, depth: int = 0) -> Any:
    k = int(rng.integers(9 if depth < 3 else 6))
    if k == 0:
        return int(rng.integers(-(10**18) + 1, 10**18))
    if k == 1:
        return float(rng.standard_normal() * 10.0 ** int(rng.integers(-300, 300)))
    if k == 2:
        cps = rng.integers(0, 0x3000, int(rng.integers(0, 12)))
        return "".join(chr(c) for c in cps if not 0xD800 <= c < 0xE000) + "\"\\/\n\t"
    if k == 3:
        return [True, False, None][int(rng.integers(3))]
    if k == 4:
        return rng.integers(0, 151_936, int(rng.integers(0, 30))).tolist()
    if k == 5:
        return float(int(rng.integers(-1000, 1000)))
    if k in (6, 7):
        return [random_value(rng, depth + 1) for _ in range(int(rng.integers(0, 5)))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(int(rng.integers(0, 5)))}


def test_json_body_values_as_json_loads():
    rng = np.random.default_rng(3)
    for trial in range(500):
        body = {f"f{i}": random_value(rng) for i in range(int(rng.integers(0, 6)))}
        raw = json.dumps(body, ensure_ascii=bool(trial % 2),
                         indent=None if trial % 3 else 2).encode()
        got = protocol.parse_json_body(raw, LIMITS)
        assert same_json(got, json_body(raw)), raw


def test_json_number_literals_as_json_loads():
    rng = np.random.default_rng(4)
    lits = []
    for _ in range(3000):
        digits = "".join(map(str, rng.integers(0, 10, int(rng.integers(1, 18)))))
        lit = ("-" if rng.random() < 0.5 else "") + (digits.lstrip("0") or "0")
        if rng.random() < 0.6:
            lit += "." + "".join(map(str, rng.integers(0, 10, int(rng.integers(1, 17)))))
        if rng.random() < 0.5:
            lit += "eE"[int(rng.integers(2))] + ["", "+", "-"][int(rng.integers(3))]
            lit += str(int(rng.integers(0, 330)))
        lits.append(lit)
    raw = ('{"x": [' + ", ".join(lits) + "]}").encode()
    assert not protocol._long_digit_run(raw)
    assert same_json(protocol.parse_json_body(raw, LIMITS), json_body(raw))
    # and a duplicated key: the last value, in the first one's place
    raw = b'{"a": 1, "b": 2, "a": 3}'
    assert same_json(protocol.parse_json_body(raw, LIMITS), json_body(raw))


def test_json_body_errors_as_json_loads():
    bodies = [
        b"", b" ", b"{", b'{"a": ', b'{"a": 1,}', b"[1, 2,]", b'{"a": 1} x', b"{'a': 1}",
        b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}', b"NaN", b'{"a": [1, NaN]}',
        b'{"a": nan}', b'{"a": "\x01"}', b'{"a": 01}', b'{"a": 1.}', b'{"a": .5}',
        b"\xff\xfe", b'{"a": "\xff"}', b'{"a": "\xc3"}',
        b"[1, 2]", b'"x"', b"1", b"1.5", b"true", b"null",
    ]
    for raw in bodies:
        want = outcome(json_body, raw)
        assert want[0] == "err", raw
        assert outcome(protocol.parse_json_body, raw, LIMITS) == want, raw
    nan = outcome(protocol.parse_json_body, b'{"a": NaN}', LIMITS)
    assert nan == ("err", InvalidField, "body", "malformed JSON: NaN is not valid JSON")


def test_json_bodies_only_json_loads_accepts():
    # orjson refuses these or reads them otherwise; json.loads' answer is kept
    bodies = [
        b'{"a": 1e400}', b'{"a": -1e400}', '\ufeff{"a": 1}'.encode(),
        '{"a": "é"}'.encode("utf-16"), '{"a": 1}'.encode("utf-32"), b'{"a": "\\ud800"}',
        b'{"\xed\xa0\x80": 1}',  # a surrogate encoded as UTF-8: json.loads lets it pass
        b'{"a": ' + b"[" * 1100 + b"]" * 1100 + b"}",
        b'{"a": 12345678901234567890}', b'{"a": 9223372036854775807}',
        b'{"a": -9223372036854775809}', b'{"a": 18446744073709551616}',
        b'{"a": 0.1234567890123456789012}', b'{"a": "tel 1234567890123456789"}',
    ]
    for raw in bodies:
        want = outcome(json_body, raw)
        assert want[0] == "ok", raw
        got = outcome(protocol.parse_json_body, raw, LIMITS)
        assert got[0] == "ok", raw
        assert same_json(got[1], want[1]) if len(raw) < 1000 else got[1] == want[1], raw


@pytest.mark.parametrize("t", [2**63, 2**64, 2**64 + 1, 2**100, -(2**63) - 1])
def test_huge_token_ids_reach_the_vocabulary_check(t):
    raw = json.dumps({"input_ids": [[1, 2], [3, t]]}).encode()
    body = protocol.parse_json_body(raw, LIMITS)
    assert type(body["input_ids"][1][1]) is int and body["input_ids"][1][1] == t
    err = outcome(protocol.parse_generate, body, LIMITS, 512)
    assert err == ("err", CacheOpError, "input_ids[1][1]", f"token id {t} outside the vocabulary")


def test_ordinary_bodies_skip_json_loads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("json.loads used")

    rng = np.random.default_rng(5)
    body = {"input_ids": [rng.integers(0, 151_936, 512).tolist() for _ in range(4)],
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 16, "seed": 10**17}}
    raw = json.dumps(body).encode()
    monkeypatch.setattr(protocol.json, "loads", refuse)
    assert same_json(protocol.parse_json_body(raw, LIMITS), body)


def test_long_digit_run_is_exact():
    rng = np.random.default_rng(6)
    run19 = re.compile(rb"[0-9]{19}")
    for _ in range(3000):
        n = int(rng.integers(0, 60))
        raw = bytes(rng.choice(list(b"0123456789 ,.[]x\xff/:"), n).tolist())
        if rng.random() < 0.5:
            at = int(rng.integers(n + 1))
            raw = raw[:at] + b"7" * int(rng.integers(15, 23)) + raw[at:]
        assert protocol._long_digit_run(raw) == bool(run19.search(raw)), raw
