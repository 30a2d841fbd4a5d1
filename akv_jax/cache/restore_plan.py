"""Host-side plan of a one-pass restore (:func:`akv_jax.cache.core.restore`).

From the timeline of a history: the padded token and position arrays of the single forward,
the write slots of every position version (one row per version; earlier versions go to
temporary pages), and one query segment per message over the pages of the version it saw.
Pure numpy; the device call is in :mod:`akv_jax.cache.core`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from akv_jax.cache.ops import OpHistory
from akv_jax.cache.timeline import Timeline, timeline
from akv_jax.pallas.metadata import SegmentSpec, bucket


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """Host-side plan of a one-pass restore over a single-sequence layout.

    Version ``E`` (the final one) is written to pages ``[0, MP)``, which become the state's
    pages; each earlier version ``e`` gets temporary pages ``[(e+1) MP, (e+2) MP)``.
    """

    timeline: Timeline
    tokens: np.ndarray  # [T_pad]
    q_positions: np.ndarray  # [T_pad]
    write_slots: np.ndarray  # [W, T_pad]
    write_positions: np.ndarray  # [W, T_pad]
    segments: list[SegmentSpec]
    pool_pages: int


def plan(
    segments: Sequence[Sequence[int]],
    history: OpHistory,
    *,
    max_pages: int,
    page_size: int,
    block_q: int,
    t_pad: int | None = None,
    num_versions: int | None = None,
) -> RestorePlan:
    """Plan the one-pass restore of ``history`` over ``segments``.

    ``t_pad`` and ``num_versions`` fix the padded token count and the number of version
    rows (extra rows write nothing), so many histories can share one compiled program.
    """
    tl = timeline([len(s) for s in segments], history)
    T = tl.num_tokens
    if T > max_pages * page_size:
        raise ValueError(f"{T} tokens exceed the capacity {max_pages * page_size}")
    E = tl.num_versions - 1
    t_pad = t_pad if t_pad is not None else bucket(T, block_q, steps_per_octave=4)
    W = max(num_versions or 0, E + 1)
    if t_pad < T or t_pad % block_q:
        raise ValueError(f"t_pad={t_pad} must be a multiple of {block_q} and >= {T}")
    tokens = np.zeros(t_pad, np.int32)
    tokens[:T] = np.concatenate([np.asarray(s, np.int32) for s in segments])
    q_pos = np.zeros(t_pad, np.int32)
    q_pos[:T] = tl.append_pos
    pool_pages = (E + 1) * max_pages
    sentinel = pool_pages * page_size

    def base_page(e: int) -> int:
        return 0 if e == E else (e + 1) * max_pages

    slots = np.full((W, t_pad), sentinel, np.int32)
    wpos = np.zeros((W, t_pad), np.int32)
    for e in range(E + 1):
        has = np.nonzero(tl.version_has[e])[0]
        slots[e, has] = base_page(e) * page_size + has
        wpos[e, :T] = tl.version_pos[e]
    specs = []
    for s in range(tl.num_segments):
        sl = tl.segment_tokens(s)
        view_pages = -(-sl.stop // page_size)
        base = base_page(int(tl.seg_epoch[s]))
        specs.append(
            SegmentSpec(
                q_start=sl.start,
                q_len=sl.stop - sl.start,
                pages=list(range(base, base + view_pages)),
                kv_visible=tl.visible_to(s),
                causal_pos=sl.start,
            )
        )
    return RestorePlan(tl, tokens, q_pos, slots, wpos, specs, pool_pages)
