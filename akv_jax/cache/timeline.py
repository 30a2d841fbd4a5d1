"""The semantics of an op history over concrete segments, computed once on the host.

:func:`timeline` walks DESIGN.md §2 (append, then drops, then repos, at each boundary) and
records, for every token, everything any execution path needs: the position it was appended
at, the segment it belongs to, when its segment is dropped, and its position in every
*position version* (one version per epoch between repositions). Incremental execution,
one-pass restore, the serving planner and the tests all derive from this one walk, so the
semantics live in one place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from akv_jax.cache.ops import OpHistory


@dataclasses.dataclass(frozen=True)
class Timeline:
    seg_lens: np.ndarray  # [n]
    seg_start: np.ndarray  # [n + 1] token offsets of the segments
    token_seg: np.ndarray  # [T] segment of each token
    append_pos: np.ndarray  # [T] RoPE position each token was computed at
    seg_epoch: np.ndarray  # [n] number of repositions before segment s was appended
    drop_boundary: np.ndarray  # [n] boundary at which segment s is dropped (n if never)
    version_pos: np.ndarray  # [E + 1, T] position of each token during epoch e
    version_has: np.ndarray  # [E + 1, T] token exists (was appended) by the end of epoch e
    final_pos: np.ndarray  # [T] positions after the last boundary
    final_active: np.ndarray  # [T] still attended after the last boundary
    next_pos: int  # position of the next appended token

    @functools.cached_property
    def seg_active(self) -> np.ndarray:
        """[n] segments with a token still attended after the last boundary."""
        out = np.zeros(len(self.seg_lens), bool)
        out[self.token_seg[self.final_active]] = True
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.seg_start[-1])

    @property
    def num_segments(self) -> int:
        return len(self.seg_lens)

    @property
    def num_versions(self) -> int:
        return self.version_pos.shape[0]

    @property
    def max_position(self) -> int:
        """Largest position any token is encoded at (repos only ever lowers positions)."""
        return int(self.append_pos.max(initial=-1))

    def visible_to(self, s: int) -> np.ndarray:
        """[seg_start[s+1]] which tokens a query of segment s may attend to (causal aside)."""
        end = self.seg_start[s + 1]
        segs = self.token_seg[:end]
        return self.drop_boundary[segs] >= s

    def active_after(self, b: int) -> np.ndarray:
        """Indices of the tokens still active after boundary ``b``'s drops, in order."""
        toks = np.arange(int(self.seg_start[b + 1]))
        return toks[self.drop_boundary[self.token_seg[toks]] > b]

    def segment_tokens(self, s: int) -> slice:
        return slice(int(self.seg_start[s]), int(self.seg_start[s + 1]))


def timeline(seg_lens: Sequence[int], history: OpHistory, start_pos: int = 0) -> Timeline:
    n = len(seg_lens)
    if history.num_segments != n:
        raise ValueError(f"history is over {history.num_segments} segments, request has {n}")
    lens = np.asarray(seg_lens, np.int64)
    start = np.concatenate([[0], np.cumsum(lens)])
    T = int(start[-1])
    token_seg = np.repeat(np.arange(n), lens)
    num_versions = len(history.repos) + 1
    # The walk visits each in-range boundary once, in order; versions past the last real
    # epoch (from a duplicate or out-of-range repos) stay zero, as the row count still counts them.
    repos = sorted({int(b) for b in history.repos if 0 <= b < n})
    # Boundary after which each segment stops being active: its first drop at or after its own
    # append (a drop at an earlier boundary is undone when the segment is appended).
    seg_drop = np.full(n, n, np.int64)
    pairs = [(b, i) for b, segs in history.drops.items() for i in segs]
    if pairs:
        b_, i_ = np.array(pairs, np.int64).reshape(-1, 2).T
        keep = (b_ >= 0) & (b_ < n) & (i_ >= 0) & (i_ <= b_)
        np.minimum.at(seg_drop, i_[keep], b_[keep])
    # Segment s was appended after every repos at a boundary < s.
    seg_epoch = np.searchsorted(np.asarray(repos, np.int64), np.arange(n)).astype(np.int64)
    version_pos = np.zeros((num_versions, T), np.int64)
    version_has = np.zeros((num_versions, T), bool)
    # Between repositions appends are contiguous, so a token's append position is its index
    # plus its epoch's offset, shifted in place to spare a temporary per epoch.
    append_pos = np.arange(T, dtype=np.int64)
    pos = np.empty(T, np.int64)
    next_pos, a = start_pos, 0
    for e, r in enumerate(repos):
        b = int(start[r + 1])
        append_pos[a:b] += next_pos - a
        pos[a:b] = append_pos[a:b]
        version_pos[e, :b] = pos[:b]
        version_has[e, :b] = True
        # Only the tokens still active are renumbered; dropped ones keep their last position.
        live_seg = seg_drop[: r + 1] > r
        live = int(lens[: r + 1][live_seg].sum())
        pos[:b][np.repeat(live_seg, lens[: r + 1])] = np.arange(live)
        next_pos, a = live, b
    append_pos[a:] += next_pos - a
    pos[a:] = append_pos[a:]
    next_pos += T - a
    version_pos[len(repos)] = pos
    version_has[len(repos)] = True
    return Timeline(
        seg_lens=lens,
        seg_start=start,
        token_seg=token_seg,
        append_pos=append_pos,
        seg_epoch=seg_epoch,
        drop_boundary=history.drop_boundary(),
        version_pos=version_pos,
        version_has=version_has,
        final_pos=pos,
        final_active=np.repeat(seg_drop == n, lens),
        next_pos=int(next_pos),
    )
