"""Op-history grammar: validation errors name field and index; encoding round-trips."""

import numpy as np
import pytest
from ops_cases import random_history

from akv_jax.cache.ops import (
    OP_APPEND,
    OP_DROP,
    OP_REPOS,
    CacheOpError,
    decode_history,
    encode_history,
    parse_history,
    validate_segments,
)
from akv_jax.cache.timeline import timeline


def test_parse_valid_and_encode_roundtrip():
    h = parse_history({"drop": {"5": [3, 1]}, "reposition": [5, 2]}, 7)
    assert h.drops == {5: (1, 3)}
    assert h.repos == (2, 5)
    lens = [3, 1, 4, 1, 5, 9, 2]
    arr = encode_history(h, lens, max_ops=16)
    assert arr.shape == (16, 3)
    rows = [tuple(r) for r in arr[: 7 + 2 + 2].tolist()]
    assert rows[:3] == [(OP_APPEND, 0, 3), (OP_APPEND, 1, 1), (OP_APPEND, 2, 4)]
    assert rows[3] == (OP_REPOS, 2, 0)
    assert (OP_DROP, 5, 1) in rows and (OP_DROP, 5, 3) in rows
    # drops come after the append of their boundary and before its repos
    i_app5 = rows.index((OP_APPEND, 5, 9))
    assert rows[i_app5 + 1 : i_app5 + 4] == [(OP_DROP, 5, 1), (OP_DROP, 5, 3), (OP_REPOS, 5, 0)]
    assert (arr[11:] == 0).all()
    back, back_lens = decode_history(arr)
    assert back == h and back_lens == lens


@pytest.mark.parametrize(
    "cache,n,field,words",
    [
        ({"drop": {"7": [1]}}, 5, 'cache.drop["7"]', "out of range"),
        ({"drop": {"-1": [0]}}, 5, 'cache.drop["-1"]', "out of range"),
        ({"drop": {"3": [9]}}, 5, 'cache.drop["3"][0]', "out of range"),
        ({"drop": {"2": [0, 3]}}, 5, 'cache.drop["2"][1]', "before it exists"),
        ({"drop": {"2": [1], "4": [1]}}, 5, 'cache.drop["4"][0]', "dropped twice"),
        ({"drop": {"2": [1, 1]}}, 5, 'cache.drop["2"][1]', "dropped twice"),
        ({"reposition": [2, 2]}, 5, "cache.reposition[1]", "duplicate"),
        ({"reposition": [5]}, 5, "cache.reposition[0]", "out of range"),
        ({"reposition": [1.5]}, 5, "cache.reposition[0]", "integer"),
        ({"reposition": ["1"]}, 5, "cache.reposition[0]", "integer"),
        ({"drop": {"2": [True]}}, 5, 'cache.drop["2"][0]', "integer"),
        ({"drop": {"x": [0]}}, 5, 'cache.drop["x"]', "integer"),
        ({"drop": {"2": 1}}, 5, 'cache.drop["2"]', "list"),
        ({"drop": [1]}, 5, "cache.drop", "object"),
        ({"squash": []}, 5, "cache.squash", "unknown"),
        ([1, 2], 5, "cache", "object"),
    ],
)
def test_parse_errors_name_field(cache, n, field, words):
    with pytest.raises(CacheOpError) as e:
        parse_history(cache, n)
    assert e.value.field == field
    assert words in str(e.value)


def test_segment_validation():
    assert [s.tolist() for s in validate_segments([1, 2, 3])] == [[1, 2, 3]]
    assert [s.tolist() for s in validate_segments([[1], [2, 3]], vocab_size=10)] == [[1], [2, 3]]
    cases = [
        ([[1], []], "input_ids[1]", "empty"),
        ([[1], [2, 1.0]], "input_ids[1][1]", "integer"),
        ([[1], [2, 99]], "input_ids[1][1]", "vocabulary"),
        ([[-1]], "input_ids[0][0]", "vocabulary"),
        ([], "input_ids", "non-empty"),
        ("abc", "input_ids", "non-empty"),
    ]
    for segs, field, words in cases:
        with pytest.raises(CacheOpError) as e:
            validate_segments(segs, vocab_size=10)
        assert e.value.field == field and words in str(e.value), (segs, str(e.value))


def test_figure10_positions():
    # A0 B1 C2 | drop B, repos -> A0 C1 | D2 | drop D -> E3 | repos -> A0 C1 E2 | F3
    h = parse_history({"drop": {"2": [1], "3": [3]}, "reposition": [2, 4]}, 6)
    tl = timeline([1] * 6, h)
    assert tl.append_pos.tolist() == [0, 1, 2, 2, 3, 3]  # A B C D E F at append time
    # D (segment 3) saw A0 C1 and itself at 2
    assert tl.version_pos[1][[0, 2, 3]].tolist() == [0, 1, 2]
    assert tl.visible_to(3).tolist() == [True, False, True, True]
    # E (segment 4) saw A0 C1 E3: drop alone does not compact
    assert tl.visible_to(4).tolist() == [True, False, True, False, True]
    assert tl.version_pos[1][4] == 3
    # after the repos at 4: A0 C1 E2, and F at 3
    assert tl.final_pos[[0, 2, 4, 5]].tolist() == [0, 1, 2, 3]
    assert tl.final_active.tolist() == [True, False, True, False, True, True]
    assert tl.next_pos == 4


def test_timeline_matches_simple_walk():
    """Positions from the timeline equal a literal simulation for random histories."""
    rng = np.random.default_rng(1)
    for _ in range(100):
        segs, h = random_history(rng, n_max=8, len_max=4, n_min=1, p_drop=0.2)
        n, lens = len(segs), [len(seg) for seg in segs]
        tl = timeline(lens, h)
        pos, act, nxt = [], [], 0
        for s in range(n):
            for _ in range(lens[s]):
                pos.append(nxt)
                act.append(True)
                nxt += 1
            owner = np.repeat(np.arange(s + 1), lens[: s + 1])
            for i in h.drops_at(s):
                for t in np.nonzero(owner == i)[0]:
                    act[t] = False
            if h.repos_at(s):
                r = 0
                for t in range(len(pos)):
                    if act[t]:
                        pos[t] = r
                        r += 1
                nxt = r
        assert tl.final_pos.tolist() == pos
        assert tl.final_active.tolist() == act
        assert tl.next_pos == nxt
