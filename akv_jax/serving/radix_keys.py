"""A request's radix keys: its history flattened into token ids and op items.

Token ids are interleaved with op items, ``("drop", ((start, end), ...))`` naming absolute
token ranges and ``("repos",)``; two requests share a radix node only on a common prefix of
tokens **and** ops, which is exactly when they have the same cache state there (DESIGN.md
§2). :class:`RequestKeys` holds them without a Python object per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from akv_jax.cache.ops import OpHistory

Key = Any  # int token id, or an op tuple


class Run(NamedTuple):
    """Tokens ``start:end`` of a request (absolute indices), with no op item between them."""

    start: int
    end: int


class Op(NamedTuple):
    """An op item and the boundary (segment index) it follows."""

    item: Key
    boundary: int


@dataclasses.dataclass(frozen=True)
class RequestKeys:
    """A request's radix keys, with no Python object per token: its tokens as one array and
    its parts in order, token runs (adjacent segments merged: a stored run may span them)
    and op items. Matching compares runs against stored runs as arrays, so a turn that
    resends a long history costs array compares, not a loop over its tokens."""

    tokens: np.ndarray  # [T] int32
    parts: tuple[Run | Op, ...]

    @staticmethod
    def of(segments: Sequence[Sequence[int]], history: OpHistory) -> RequestKeys:
        """The keys of ``segments`` under ``history`` (the one statement of how a history
        becomes keys): after segment s, its drops (one item naming the absolute token
        ranges it drops, so two requests share it only when they drop the same tokens),
        then its repos."""
        arrays = [np.asarray(s, np.int32) for s in segments]
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        starts = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).tolist()
        parts: list[Run | Op] = []
        run_start = 0
        n = len(arrays)
        # Only the boundaries with ops, and the last, end a run: work per op, not per segment.
        ends = sorted({b for b, segs in history.drops.items() if segs and 0 <= b < n}
                      | {b for b in history.repos if 0 <= b < n} | ({n - 1} if n else set()))
        for s in ends:
            ops: list[Key] = []
            if history.drops_at(s):
                ops.append(("drop", tuple((starts[i], starts[i + 1])
                                          for i in history.drops_at(s))))
            if history.repos_at(s):
                ops.append(("repos",))
            if starts[s + 1] > run_start:
                parts.append(Run(run_start, starts[s + 1]))
            run_start = starts[s + 1]
            parts.extend(Op(op, s) for op in ops)
        return RequestKeys(tokens, tuple(parts))

    @staticmethod
    def from_flat(keys: Sequence[Key]) -> RequestKeys:
        """Keys given as a flat list (token ids and op items; tests, offline estimates)."""
        tokens: list[int] = []
        parts: list[Run | Op] = []
        run_start = 0
        for k in keys:
            if isinstance(k, (int, np.integer)):
                tokens.append(int(k))
                continue
            if len(tokens) > run_start:
                parts.append(Run(run_start, len(tokens)))
            run_start = len(tokens)
            parts.append(Op(k, -1))
        if len(tokens) > run_start:
            parts.append(Run(run_start, len(tokens)))
        return RequestKeys(np.asarray(tokens, np.int32), tuple(parts))

    def flat(self) -> list[Key]:
        """The keys as one list: token ids (ints) interleaved with op items."""
        out: list[Key] = []
        for part in self.parts:
            if isinstance(part, Run):
                out.extend(self.tokens[part.start : part.end].tolist())
            else:
                out.append(part.item)
        return out


def request_keys(segments: Sequence[Sequence[int]], history: OpHistory) -> list[Key]:
    """Radix keys of a request as one flat list (see :class:`RequestKeys`)."""
    return RequestKeys.of(segments, history).flat()
