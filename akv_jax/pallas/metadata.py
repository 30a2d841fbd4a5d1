"""Metadata of a segment batch: the one description every attention path reads.

A *segment batch* is a ragged set of query segments. Each segment has

* a run of query tokens (rows ``q_start .. q_start + q_len`` of the flat query array),
* a *view*: a page list whose slots, in order, are the keys the segment may read, and a
  per-slot visibility flag (dropped tokens, tokens of another position version, and padding
  are invisible),
* a causal anchor: query row ``i`` of the segment sits at view index ``causal_pos + i`` and
  sees only view indices ``<= causal_pos + i``. Under a sliding window of ``W`` it sees the
  ``W`` most recent *visible* slots among those (DESIGN §2.1: invisible slots take no room in
  the window, so it reaches past a dropped span); the attention paths derive that from
  ``kv_visible`` themselves (:func:`akv_jax.pallas.plan.window_start`), so the metadata
  carries no window field.

Decode (one query token per request), prefill (a new segment after cached ones) and one-pass
restore (many segments, each over the position version it originally saw) are all segment
batches. Queries are cut into blocks of ``block_q`` rows that never straddle a segment, which
is the unit the kernels' grids and the reference's ``lax.map`` iterate over.

Everything here is host-side numpy; :class:`SegmentBatch` is the device pytree, and
:data:`AttentionFn` the signature of every attention over it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Finite "minus infinity" for masked scores, shared by every attention path: a fully masked
# row then gives exact zeros (exp underflows) instead of NaN from inf - inf.
NEG_INF = -1e30


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentBatch:
    # per query block (NB blocks of block_q rows)
    block_seg: jax.Array  # [NB] int32 segment of the block, -1 for a padding block
    block_q_start: jax.Array  # [NB] int32 first query row of the block
    block_q_len: jax.Array  # [NB] int32 valid rows in the block
    block_kv_pos: jax.Array  # [NB] int32 view index of the block's first row (causal anchor)
    # per segment (S segments, views of at most MP pages)
    page_table: jax.Array  # [S, MP] int32 physical pages of the view, in view order
    kv_len: jax.Array  # [S] int32 slots of the view in use
    kv_visible: jax.Array  # [S, MP * page_size] bool: slot may be attended
    page_visible: jax.Array  # [S, MP] bool: page holds at least one visible slot (else skipped)

    @property
    def num_blocks(self) -> int:
        return self.block_seg.shape[0]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]


# attention(q [T,Hq,Dh], k_pages, v_pages, batch, layer=None, sinks=None) -> [T,Hq,Dh]: k/v_pages
# are one layer's pool [P, ps, Hkv, Dh], or every layer's [L, P, ps, Hkv, Dh] with ``layer``
# picking one; ``sinks`` [Hq] per-head sink logits (an extra softmax term with no value).
# akv_jax.pallas.dispatch.make_attention_fn makes them; akv_jax.model.forward calls them.
AttentionFn = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class SegmentSpec:
    """Host description of one query segment (input to :func:`build_segment_batch`)."""

    q_start: int
    q_len: int
    pages: Sequence[int]  # physical page ids of the view, in order
    kv_visible: np.ndarray  # [kv_len] bool
    causal_pos: int  # view index of the segment's first query row


def bucket(n: int, minimum: int = 8, steps_per_octave: int = 1) -> int:
    """Padded size for ``n``: the padding rule that bounds recompiles.

    With one step per octave, the next power of two times ``minimum`` (>= n). With more,
    each octave is cut into that many equal steps (rounded to multiples of ``minimum``), so
    padding wastes at most 1/steps of the work at the cost of a few more compiled shapes.
    """
    b = minimum
    while b < n:
        b *= 2
    if steps_per_octave > 1 and b > minimum:
        lo = b // 2
        step = max(minimum, lo // steps_per_octave)
        b = min(b, lo + -(-(n - lo) // step) * step)
        b = -(-b // minimum) * minimum
    return b


def pages_with_a_slot(slots: np.ndarray) -> np.ndarray:
    """``slots.any(axis=-1)`` for a bool ``[..., page_size]`` array, eight slots a word when
    the page size allows (numpy reduces a short last axis one slot at a time)."""
    ps = slots.shape[-1]
    if ps % 8 or not slots.flags.c_contiguous:
        return slots.any(axis=-1)
    words = slots.view(np.uint64)
    acc = words[..., 0].copy()
    for i in range(1, ps // 8):
        acc |= words[..., i]
    return acc != 0


def build_segment_batch(
    segments: Sequence[SegmentSpec],
    *,
    page_size: int,
    block_q: int,
    num_blocks: int | None = None,
    num_segments: int | None = None,
    max_pages: int | None = None,
    on_device: bool = True,
) -> SegmentBatch:
    """Cut segments into query blocks and pad every array to a static size.

    Sizes left as None are bucketed to the next power of two, so repeated calls with similar
    shapes reuse one compiled program. ``on_device=False`` leaves the arrays in numpy, for a
    caller that passes them straight to a jitted function (one transfer for all of them).
    """
    blocks: list[tuple[int, int, int, int]] = []
    for s, seg in enumerate(segments):
        if seg.q_len <= 0:
            raise ValueError(f"segment {s} has no query tokens")
        for off in range(0, seg.q_len, block_q):
            blocks.append(
                (s, seg.q_start + off, min(block_q, seg.q_len - off), seg.causal_pos + off)
            )
    need_pages = max((len(seg.pages) for seg in segments), default=1)
    nb = num_blocks if num_blocks is not None else bucket(len(blocks), 1)
    ns = num_segments if num_segments is not None else bucket(len(segments), 1)
    mp = max_pages if max_pages is not None else bucket(need_pages, 1)
    if len(blocks) > nb or len(segments) > ns or need_pages > mp:
        raise ValueError(
            f"segment batch exceeds its static size: blocks {len(blocks)}/{nb}, "
            f"segments {len(segments)}/{ns}, pages {need_pages}/{mp}"
        )
    block_arr = np.zeros((nb, 4), np.int32)
    block_arr[:, 0] = -1
    if blocks:
        block_arr[: len(blocks)] = np.asarray(blocks, np.int32)
    page_table = np.zeros((ns, mp), np.int32)
    kv_len = np.zeros((ns,), np.int32)
    kv_visible = np.zeros((ns, mp * page_size), bool)
    for s, seg in enumerate(segments):
        n = len(seg.kv_visible)
        if n > len(seg.pages) * page_size:
            raise ValueError(f"segment {s}: view of {n} slots but only {len(seg.pages)} pages")
        page_table[s, : len(seg.pages)] = seg.pages
        kv_len[s] = n
        kv_visible[s, :n] = seg.kv_visible
    page_visible = pages_with_a_slot(kv_visible.reshape(ns, mp, page_size))
    put = jnp.asarray if on_device else np.ascontiguousarray
    return SegmentBatch(
        block_seg=put(block_arr[:, 0]),
        block_q_start=put(block_arr[:, 1]),
        block_q_len=put(block_arr[:, 2]),
        block_kv_pos=put(block_arr[:, 3]),
        page_table=put(page_table),
        kv_len=put(kv_len),
        kv_visible=put(kv_visible),
        page_visible=put(page_visible),
    )
