"""The /generate fast path (segment_memo.py) against the general parse of the same bytes.

Oracle: ``protocol.parse_generate_bytes(raw)`` with no memo, the path every body took before
the memo (``parse_json_body`` then ``parse_generate``). For valid bodies the fast path must
give the same segments, history and sampling; for invalid ones the very same error (field
and message), whichever path words it.
"""

import json

import numpy as np
import pytest

from akv_jax.errors import InvalidField
from akv_jax.serving import protocol
from akv_jax.serving.segment_memo import SegmentMemo

VOCAB = 100
LIMITS = protocol.Limits()


def general(raw: bytes):
    try:
        return protocol.parse_generate_bytes(raw, LIMITS, VOCAB)
    except InvalidField as e:
        return e


def fast(raw: bytes, memo: SegmentMemo):
    try:
        return protocol.parse_generate_bytes(raw, LIMITS, VOCAB, memo)
    except InvalidField as e:
        return e


def same(a, b) -> None:
    if isinstance(a, Exception):
        assert isinstance(b, InvalidField), (a, b)
        assert (b.field, str(b)) == (a.field, str(a))
        return
    assert not isinstance(b, Exception), b
    assert [s.tolist() for s in b.segments] == [list(map(int, s)) for s in a.segments]
    assert all(s.dtype == np.int32 for s in b.segments)
    assert (b.history, b.sampling, b.stream, b.return_logprob) == (
        a.history, a.sampling, a.stream, a.return_logprob)


def spaced(rng: np.random.Generator, segs: list[list[int]]) -> str:
    """input_ids written with random white space, as a client might."""
    def ws() -> str:
        return "".join(rng.choice([" ", "\n", "\t", "\r", ""], size=int(rng.integers(0, 3))))

    return "[" + ws() + ",".join(
        ws() + "[" + ",".join(ws() + str(t) + ws() for t in s) + "]" + ws() for s in segs
    ) + "]"


def test_valid_bodies_equal_the_general_parse_and_hit_the_memo():
    rng = np.random.default_rng(0)
    memo = SegmentMemo(VOCAB)
    history: list[list[int]] = []
    for turn in range(40):
        history.append(rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist())
        cache = {"drop": {str(len(history) - 1): [1]}} if turn > 3 and turn % 5 == 0 else {}
        ids = spaced(rng, history) if turn % 3 == 0 else json.dumps(history)
        rest = json.dumps({"cache": cache, "sampling_params": {"max_new_tokens": 3,
                                                               "temperature": 0.5}})
        raw = ('{"input_ids": ' + ids + ", " + rest[1:]).encode()
        same(general(raw), fast(raw, memo))
    assert memo.hits > memo.misses > 0  # the history's segments were parsed once
    assert memo.prefix_hits > 0  # and a turn written as the last one was scanned from there


KNOWN = b'{"input_ids": [[1, 2], [3]], "stream": false}'


@pytest.mark.parametrize("raw", [
    KNOWN,
    b'{"input_ids": [[1, 2], [3], [4, 5]]}',
    b'{"input_ids": [[1, 2], [3] ,\n[4, 5] ] }',
    b'{"input_ids": [[1, 2], [3] [4]]}',  # a comma missing after the known prefix
    b'{"input_ids": [[1, 2], [3],, [4]]}',
    b'{"input_ids": [[1, 2], [3],]}',
    b'{"input_ids": [[1, 2], [3], [[4]]]}',
    b'{"input_ids": [[1, 2], [3]5]}',
    b'{"input_ids": [[1, 2], [3], []]}',
    b'{"input_ids": [[1, 2], [3], [100]]}',
    b'{"input_ids": [[1, 2], [3], 4]}',
    b'{"input_ids": [[1, 2], [3]] trailing',
    b'{"input_ids": [[1, 2], [3], [4]',
    b'{"input_ids": [[1, 2], [3]]], "stream": true}',
    b'{"input_ids": [[1, 2], [3]], "input_ids": [[4]]}',
    b'{"input_ids": [[1, 2], [31]]}',  # starts with the prefix's bytes but one segment
    b'{"input_ids": [[1, 2], [3], [4, 5]], "cache": {"drop": {"2": [1]}}}',
])
def test_bodies_after_a_known_prefix_match_the_general_path(raw: bytes):
    """Scanned from a kept prefix (a session's last body), a body must still read exactly
    as the general parse reads it, errors included."""
    memo = SegmentMemo(VOCAB)
    same(general(KNOWN), fast(KNOWN, memo))
    before = memo.prefix_hits
    same(general(raw), fast(raw, memo))
    if raw.startswith(b'{"input_ids": [[1, 2], [3]'):
        assert memo.prefix_hits == before + (not raw.startswith(b'{"input_ids": [[1, 2], [31')
                                             ), "the kept prefix was not used"


@pytest.mark.parametrize("raw", [
    b'{"input_ids": [[1, 2], [3]], "input_ids": [[4]]}',  # given twice: the last wins
    b'{"input_ids": [[1, 2], [3]]} trailing',
    b'{"input_ids": [[1, 2] [3]]}',  # a comma missing
    b'{"input_ids": [[1, 2],, [3]]}',
    b'{"input_ids": [, [1, 2]]}',
    b'{"input_ids": [[1, 2], []]}',
    b'{"input_ids": [[1, 2], [ ]]}',
    b'{"input_ids": [[1, 2], [true]]}',
    b'{"input_ids": [[1, 2], [1.0]]}',
    b'{"input_ids": [[1, 2], [-1]]}',
    b'{"input_ids": [[1, 2], [100]]}',
    b'{"input_ids": [[1, 2], [18446744073709551616]]}',
    b'{"input_ids": [[1, [2]]]}',
    b'{"input_ids": [1, 2, 3]}',
    b'{"input_ids": [[1, 2], 3]}',
    b'{"input_ids": [], "cache": {}}',
    b'{"input_ids": [[1, 2]], "cache": {"drop": {"0": [0]}}, "stream": NaN}',
    b'{"input_ids": [[1, 2]], "cache": {"drop": {"5": [0]}}}',
    b'{"input_ids": [[1, 2]], "sampling_params": {"seed": 123456789012345678901}}',
    b'{"input_ids": [[1, 2]], "bogus": 1}',
    b'{"input_ids": [[1, 2]]',
    b'{"cache": {}, "input_ids": [[1, 2], [3]]}',
    b'  {\n "input_ids" :[[1,2],[3]] , "stream": false}',
])
def test_edge_bodies_match_the_general_path(raw: bytes):
    memo = SegmentMemo(VOCAB)
    same(general(raw), fast(raw, memo))
    same(general(raw), fast(raw, memo))  # again, now with whatever the memo kept


def test_memo_is_bounded_and_its_arrays_read_only():
    memo = SegmentMemo(VOCAB, max_bytes=4096)
    for i in range(200):
        raw = json.dumps({"input_ids": [[i % VOCAB] * 50]}).encode()
        body, segs = memo.split(raw)
        assert segs[0].tolist() == [i % VOCAB] * 50
        with pytest.raises(ValueError):
            segs[0][0] = 1
    assert memo.nbytes <= 4096 and len(memo) < 200


def test_a_session_is_scanned_from_its_last_body():
    """Turn after turn, a session's body is scanned from the end of its last one: its
    earlier segments are neither looked up nor parsed again."""
    rng = np.random.default_rng(1)
    memo = SegmentMemo(VOCAB)
    history: list[list[int]] = []
    for turn in range(20):
        history.append(rng.integers(0, VOCAB, 20).tolist())
        raw = json.dumps({"input_ids": history, "sampling_params": {"max_new_tokens": turn + 1}})
        same(general(raw.encode()), fast(raw.encode(), memo))
        assert memo.prefix_hits == turn
        assert memo.misses == turn + 1  # one new segment parsed a turn

