"""Op histories: the API grammar, its validation, and the int32 array encoding.

API grammar (operate-after): ``{"drop": {"5": [1, 3]}, "reposition": [5, 9]}`` means
"after appending segment 5, drop segments 1 and 3; after segments 5 and 9, reposition".

Array encoding (one row per op, in execution order, int32 ``[n_ops, 3]``):

=========  ==========  ===============================  =============================
opcode     name        boundary                         argument
=========  ==========  ===============================  =============================
1          APPEND      segment index s                  number of tokens appended
2          DROP        boundary s (after segment s)     dropped segment index i (i <= s)
3          REPOS       boundary s                       0
=========  ==========  ===============================  =============================

Order at each boundary s: APPEND s, then its DROPs (ascending), then REPOS. Rows past the
history's length are padding (opcode 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from akv_jax.errors import InvalidField

OP_PAD, OP_APPEND, OP_DROP, OP_REPOS = 0, 1, 2, 3


class CacheOpError(InvalidField):
    """An invalid op history or segment list; ``field`` names where (e.g.
    ``cache.drop["5"][1]``)."""


@dataclasses.dataclass(frozen=True)
class OpHistory:
    """A validated op history over ``num_segments`` segments."""

    num_segments: int
    drops: Mapping[int, tuple[int, ...]]  # boundary -> segments dropped there (ascending)
    repos: tuple[int, ...]  # boundaries with a reposition (ascending)

    def drops_at(self, boundary: int) -> tuple[int, ...]:
        return self.drops.get(boundary, ())

    def repos_at(self, boundary: int) -> bool:
        return boundary in self.repos

    def drop_boundary(self) -> np.ndarray:
        """[num_segments] boundary at which each segment is dropped (num_segments if never)."""
        out = np.full(self.num_segments, self.num_segments, np.int64)
        for b, segs in self.drops.items():
            out[list(segs)] = b
        return out

    def truncate(self, num_segments: int) -> OpHistory:
        """The history of the first ``num_segments`` segments (a prefix request)."""
        drops = {b: s for b, s in self.drops.items() if b < num_segments}
        return OpHistory(num_segments, drops, tuple(b for b in self.repos if b < num_segments))

    def to_api(self) -> dict[str, Any]:
        return {
            "drop": {str(b): list(s) for b, s in sorted(self.drops.items())},
            "reposition": list(self.repos),
        }

    @staticmethod
    def empty(num_segments: int) -> OpHistory:
        return OpHistory(num_segments, {}, ())


def _as_int(value: Any, field: str, allow_str: bool = False) -> int:
    """An int, or (for JSON object keys) a decimal string; bool is never an index."""
    if allow_str and isinstance(value, str):
        try:
            return int(value, 10)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int):
        raise CacheOpError(field, f"expected an integer, got {value!r}")
    return value


def parse_history(cache: Any, num_segments: int, field: str = "cache") -> OpHistory:
    """Validate the API ``cache`` object against a request of ``num_segments`` segments.

    Raises :class:`CacheOpError` naming the field and index of the first problem.
    """
    if cache is None:
        return OpHistory.empty(num_segments)
    if not isinstance(cache, Mapping):
        raise CacheOpError(field, "expected an object with 'drop' and/or 'reposition'")
    unknown = set(cache) - {"drop", "reposition"}
    if unknown:
        raise CacheOpError(f"{field}.{sorted(unknown)[0]}", "unknown cache operation")
    drops: dict[int, tuple[int, ...]] = {}
    dropped_at: dict[int, int] = {}
    raw_drops = cache.get("drop") or {}
    if not isinstance(raw_drops, Mapping):
        raise CacheOpError(f"{field}.drop", "expected an object mapping boundary -> segments")
    for key, segs in raw_drops.items():
        kfield = f'{field}.drop["{key}"]'
        b = _as_int(key, kfield, allow_str=True)
        if not 0 <= b < num_segments:
            raise CacheOpError(kfield, f"boundary {b} out of range [0, {num_segments})")
        if b in drops:
            raise CacheOpError(kfield, f"boundary {b} given twice")
        if not isinstance(segs, Sequence) or isinstance(segs, (str, bytes)):
            raise CacheOpError(kfield, "expected a list of segment indices")
        out = []
        for j, seg in enumerate(segs):
            sfield = f"{kfield}[{j}]"
            i = _as_int(seg, sfield)
            if not 0 <= i < num_segments:
                raise CacheOpError(sfield, f"segment {i} out of range [0, {num_segments})")
            if i > b:
                raise CacheOpError(
                    sfield, f"segment {i} is dropped at boundary {b} before it exists"
                )
            if i in dropped_at:
                raise CacheOpError(
                    sfield, f"segment {i} is dropped twice (already at boundary {dropped_at[i]})"
                )
            dropped_at[i] = b
            out.append(i)
        if out:
            drops[b] = tuple(sorted(out))
    raw_repos = cache.get("reposition") or []
    if not isinstance(raw_repos, Sequence) or isinstance(raw_repos, (str, bytes)):
        raise CacheOpError(f"{field}.reposition", "expected a list of boundaries")
    repos: list[int] = []
    for j, v in enumerate(raw_repos):
        rfield = f"{field}.reposition[{j}]"
        b = _as_int(v, rfield)
        if not 0 <= b < num_segments:
            raise CacheOpError(rfield, f"boundary {b} out of range [0, {num_segments})")
        if b in repos:
            raise CacheOpError(rfield, f"duplicate reposition boundary {b}")
        repos.append(b)
    return OpHistory(num_segments, drops, tuple(sorted(repos)))


def encode_history(history: OpHistory, seg_lens: Sequence[int], max_ops: int | None = None):
    """The int32 [n_ops, 3] array encoding (padded with OP_PAD rows to ``max_ops``)."""
    rows: list[tuple[int, int, int]] = []
    for s in range(history.num_segments):
        rows.append((OP_APPEND, s, int(seg_lens[s])))
        rows.extend((OP_DROP, s, i) for i in history.drops_at(s))
        if history.repos_at(s):
            rows.append((OP_REPOS, s, 0))
    n = max_ops if max_ops is not None else len(rows)
    if len(rows) > n:
        raise ValueError(f"history has {len(rows)} ops, more than max_ops={n}")
    out = np.zeros((n, 3), np.int32)
    if rows:
        out[: len(rows)] = rows
    return out


def decode_history(ops: np.ndarray) -> tuple[OpHistory, list[int]]:
    """Inverse of :func:`encode_history`: (history, segment lengths)."""
    seg_lens: list[int] = []
    drops: dict[int, list[int]] = {}
    repos: list[int] = []
    for code, b, arg in np.asarray(ops).tolist():
        if code == OP_APPEND:
            seg_lens.append(arg)
        elif code == OP_DROP:
            drops.setdefault(b, []).append(arg)
        elif code == OP_REPOS:
            repos.append(b)
    return (
        OpHistory(len(seg_lens), {b: tuple(v) for b, v in drops.items()}, tuple(repos)),
        seg_lens,
    )


def token_outside_vocab(t: int, vocab_size: int | None) -> str | None:
    """Why token id ``t`` is not in a vocabulary of ``vocab_size`` ids (None if it is):
    the one statement of the rule, for prompts and stop tokens alike."""
    if t < 0 or (vocab_size is not None and t >= vocab_size):
        return f"token id {t} outside the vocabulary"
    return None


_INT32_END = 2**31  # token ids leave here as int32: with no vocabulary, the bound they stay under


def validate_segments(
    segments: Any, field: str = "input_ids", vocab_size: int | None = None
) -> list[np.ndarray]:
    """Segments as a list of non-empty 1-D int32 arrays of in-vocabulary token ids.

    A segment is a list (or tuple) of ints, or a 1-D numpy integer array, checked whole (an
    int32 one comes back as is, not copied: its owner must not change it); a flat list of
    ints is one segment. Token ids are ``int``s (not bools, floats, strings, None, lists or
    numpy scalars) with ``token_outside_vocab`` false; with no ``vocab_size`` they must still
    fit int32 (an id >= 2**31 is outside the vocabulary). Raises :class:`CacheOpError`
    naming the index of the first problem (``input_ids[2][5]``).

    The common case costs C-speed passes per segment (its element types, one conversion, one
    range reduction); only a request with a problem, or with unusual elements (int
    subclasses, non-integer arrays), is walked token by token in Python, and that walk
    alone words the errors.
    """
    if not isinstance(segments, Sequence) or isinstance(segments, (str, bytes)) or not segments:
        raise CacheOpError(field, "expected a non-empty list of token-id lists")
    kinds = set(map(type, segments))
    flat_types = None  # a flat list's element types, known already
    if not any(issubclass(k, (Sequence, np.ndarray)) for k in kinds):
        segments, flat_types = [segments], kinds
    end = _INT32_END if vocab_size is None else min(vocab_size, _INT32_END)
    if kinds == {np.ndarray} and all(
        a.ndim == 1 and a.dtype == np.int32 and a.size for a in segments
    ):
        # The API's segments (int32 arrays already): one range check over all of them.
        if np.concatenate(segments).view(np.uint32).max() < end:
            return list(segments)
        return _walk_segments(segments, field, end)
    out = []
    for seg in segments:
        ids = _segment_array(seg, end, flat_types)
        if ids is None:  # something to report, or to look at token by token
            return _walk_segments(segments, field, end)
        out.append(ids)
    return out


def _segment_array(seg: Any, end: int, types: set | None) -> np.ndarray | None:
    """``seg`` as an int32 array if it is plainly valid (ids in ``[0, end)``), else None."""
    if isinstance(seg, np.ndarray):
        if seg.ndim != 1 or seg.dtype.kind not in "iu" or seg.size == 0:
            return None
        if seg.min() < 0 or seg.max() >= end:
            return None
        return seg.astype(np.int32, copy=False)
    if isinstance(seg, (str, bytes)) or not isinstance(seg, Sequence) or not seg:
        return None
    if types is None:
        types = set(map(type, seg))
    if types != {int}:  # exactly int: a bool, float, str, None or list is no token id
        return None
    try:
        a = np.asarray(seg, np.int32)
    except OverflowError:  # beyond int32: outside the vocabulary (end <= 2**31)
        return None
    # A negative id is >= 2**31 as uint32: one reduction checks both ends of [0, end).
    if a.view(np.uint32).max() >= end:
        return None
    return a


def _walk_segments(segments: Sequence, field: str, end: int) -> list[np.ndarray]:
    """:func:`validate_segments` token by token: raises for the first problem, in order."""
    out = []
    for i, seg in enumerate(segments):
        f = f"{field}[{i}]"
        if isinstance(seg, np.ndarray) and seg.ndim == 1:
            seg = seg.tolist()  # Python ints (or the bools / floats that are reported)
        if not isinstance(seg, Sequence) or isinstance(seg, (str, bytes)):
            raise CacheOpError(f, "expected a list of token ids")
        if len(seg) == 0:
            raise CacheOpError(f, "empty segment")
        for j, t in enumerate(seg):
            if isinstance(t, bool) or not isinstance(t, int):
                raise CacheOpError(f"{f}[{j}]", f"expected an integer token id, got {t!r}")
            # ``end`` is the vocabulary's size, or less where ids would not fit int32; the
            # message names only the id, so it is the vocabulary's.
            if (why := token_outside_vocab(t, end)) is not None:
                raise CacheOpError(f"{f}[{j}]", why)
        out.append(np.asarray(seg, np.int32))
    return out


def add_random_ops(rng: np.random.Generator, cache: dict[str, Any], boundary: int,
                   dropped: set[int], p_drop: float, p_repos: float) -> None:
    """Fuzzing helper: random ops at ``boundary`` of an API-form ``cache`` (in place).

    Each segment up to the boundary not in ``dropped`` (the one just appended included, so
    drops land in the middle and at the last boundary) is dropped with probability
    ``p_drop``; then a reposition with probability ``p_repos``. The tests and
    ``bench/soak.py`` build their random histories with it."""
    cand = [i for i in range(boundary + 1) if i not in dropped and rng.random() < p_drop]
    if cand:
        cache["drop"][str(boundary)] = cand
        dropped.update(cand)
    if rng.random() < p_repos:
        cache["reposition"].append(boundary)
