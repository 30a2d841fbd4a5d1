"""Device-side plan shared by both attention kernel bodies: which pages each query block reads.

The kernels never look at invisible pages. This module turns a :class:`SegmentBatch` into

* per segment, the list of its *visible* pages compacted to the front (view order kept), and
  for every slot of those pages the view index the slot sits at (``-1`` when the slot may not
  be attended: dropped, another position version, past ``kv_len``);
* per query block, the half-open range ``[lo, hi)`` of that compacted list it must read:
  pages past the block's last causal row, and pages wholly before its sliding window, are cut
  off as well.

A sliding window of ``W`` counts *visible* slots (DESIGN §2.1): a query row at view index
``c`` sees the ``W`` most recent visible slots at or before ``c``, itself included. Invisible
slots (dropped entries, other position versions, page padding) take no room in it, so after a
drop a window reaches further back; with every slot visible it is ``c - W < j <= c``.
:func:`window_start` turns that into a view index per row (the smallest slot the row may see),
so kernels keep comparing view indices and pages wholly before it are skipped like dropped ones.

A kernel then loops exactly ``hi - lo`` pages, so dropped KV costs neither bandwidth nor a loop
iteration. Everything is plain ``jnp`` on ``[S, MP]``-sized arrays, cheap next to attention
itself, and computed inside the same jit as the kernel (so callers can keep building segment
batches on the host or on the device as they like).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from akv_jax.pallas.metadata import SegmentBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
    """Per query block metadata (a possibly re-cut copy of the SegmentBatch block arrays)."""

    seg: jax.Array  # [NB] int32, -1 for padding
    q_start: jax.Array  # [NB] int32
    q_len: jax.Array  # [NB] int32 (0 for padding)
    kv_pos: jax.Array  # [NB] int32 view index of row 0

    @property
    def num_blocks(self) -> int:
        return self.seg.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagePlan:
    pages: jax.Array  # [S, MPp] int32 physical ids of visible pages, padded with a visible one
    order: jax.Array  # [S, MP] int32 view page of each compacted page (visible ones first)
    slot_pos: jax.Array | None  # [S, MPp, page_size] int32 view index of each slot, -1 = masked
    lo: jax.Array  # [NB] int32 first compacted page a block reads
    hi: jax.Array  # [NB] int32 one past the last


def blocks_of(batch: SegmentBatch) -> Blocks:
    real = batch.block_seg >= 0
    return Blocks(
        seg=batch.block_seg,
        q_start=batch.block_q_start,
        q_len=jnp.where(real, batch.block_q_len, 0),
        kv_pos=batch.block_kv_pos,
    )


def split_blocks(blocks: Blocks, block_q: int, sub_q: int) -> Blocks:
    """Cut every block of ``block_q`` rows into ``cdiv(block_q, sub_q)`` blocks of ``sub_q``.

    A kernel tile holds ``rows x group`` query vectors; cutting keeps that small for large GQA
    groups (and gives each sub-block its own, shorter, causal page range).
    """
    parts = -(-block_q // sub_q)
    if parts == 1:
        return blocks
    off = jnp.arange(parts, dtype=jnp.int32) * sub_q  # [parts]

    def cut(x):
        return x[:, None] + off[None, :]

    q_len = jnp.clip(blocks.q_len[:, None] - off[None, :], 0, sub_q)
    seg = jnp.where(q_len > 0, blocks.seg[:, None], -1)
    return Blocks(
        seg=seg.reshape(-1),
        q_start=cut(blocks.q_start).reshape(-1),
        q_len=q_len.reshape(-1),
        kv_pos=cut(blocks.kv_pos).reshape(-1),
    )


def visible_slots(batch: SegmentBatch) -> jax.Array:
    """[S, MP * page_size] bool: the slots a segment may attend (visible and within kv_len)."""
    slot = jnp.arange(batch.kv_visible.shape[1], dtype=jnp.int32)
    return batch.kv_visible & (slot[None, :] < batch.kv_len[:, None])


def window_start(
    batch: SegmentBatch, seg: jax.Array, pos: jax.Array, sliding_window: int
) -> jax.Array:
    """Smallest view index a query at view index ``pos`` of segment ``seg`` may attend.

    The row sees the ``sliding_window`` most recent *visible* slots at or before ``pos``
    (itself included when visible): the visible slots ``j`` in ``[start, pos]``. ``seg`` and
    ``pos`` are int arrays of one shape (``seg`` < 0, padding, reads segment 0); so is the
    result. With every slot visible, ``start = max(pos - sliding_window + 1, 0)``.
    """
    if sliding_window < 1:
        raise ValueError(f"sliding window must be >= 1, got {sliding_window}")
    S, N = batch.kv_visible.shape
    # rank[s, j]: visible slots of segment s in [0, j].
    rank = jnp.cumsum(visible_slots(batch), axis=1, dtype=jnp.int32)  # [S, N]
    seg = jnp.clip(seg, 0, S - 1).astype(jnp.int32)
    need = rank[seg, jnp.clip(pos, 0, N - 1)] - sliding_window + 1  # rank of the oldest seen
    # The first slot of rank >= need: one search over every segment's ranks laid end to end,
    # each offset past the previous one (segment s holds s * (N + 1) + rank), so one sorted
    # array serves every row without a per-block copy of its segment's ranks.
    flat = (rank + (jnp.arange(S, dtype=jnp.int32) * (N + 1))[:, None]).reshape(-1)
    found = jnp.searchsorted(flat, seg * (N + 1) + need, side="left").astype(jnp.int32)
    return jnp.where(need <= 1, 0, found - seg * N).astype(jnp.int32)


def row_window_starts(
    batch: SegmentBatch, blocks: Blocks, rows: int, sliding_window: int
) -> jax.Array:
    """[NB, rows] :func:`window_start` of each row of each block (``rows`` per block)."""
    pos = blocks.kv_pos[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]
    seg = jnp.broadcast_to(blocks.seg[:, None], pos.shape)
    return window_start(batch, seg, pos, sliding_window)


def plan_pages(
    batch: SegmentBatch,
    blocks: Blocks,
    *,
    page_size: int,
    sliding_window: int | None = None,
    pad_pages_to: int = 1,
    slots: bool = True,
) -> PagePlan:
    """Compact each segment's visible pages and give each block its range of them.

    ``pad_pages_to``: the compacted page axis is padded to a multiple of it (a kernel reading
    ``n`` pages per step may then read past ``hi`` without going out of bounds).
    ``slots=False`` leaves ``slot_pos`` out (None), for a kernel that finds a compacted
    slot's view index from ``order`` and the batch's ``kv_visible`` itself: the plan is then
    work per page, not per slot of every padded segment.
    """
    S, MP = batch.page_table.shape
    ps = page_size
    page_start = jnp.arange(MP, dtype=jnp.int32) * ps
    # The contract: page_visible marks pages holding a visible slot; the rest are skipped.
    page_ok = batch.page_visible & (page_start[None, :] < batch.kv_len[:, None])  # [S, MP]

    # Visible pages first in view order, then the rest in order: a stable partition, as
    # argsort(~page_ok, stable=True) gives it, by prefix counts and one scatter (a sort over
    # a long view's pages cost more than the attention it plans, on the CPU).
    count = page_ok.sum(axis=1).astype(jnp.int32)  # [S]
    ok_cum = jnp.cumsum(page_ok, axis=1, dtype=jnp.int32)  # one scan: XLA:CPU's are slow
    ok_rank = ok_cum - 1
    other_rank = count[:, None] + jnp.arange(MP, dtype=jnp.int32)[None, :] - ok_cum
    dest = jnp.where(page_ok, ok_rank, other_rank)  # [S, MP] a permutation of each row
    rows = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[:, None], (S, MP))
    order = jnp.zeros((S, MP), jnp.int32).at[rows, dest].set(
        jnp.broadcast_to(jnp.arange(MP, dtype=jnp.int32)[None, :], (S, MP)),
        unique_indices=True,
    )
    in_list = jnp.arange(MP)[None, :] < count[:, None]
    phys = jnp.take_along_axis(batch.page_table, order, axis=1)
    # Pad with the last visible page (already in cache) so padded reads cost nothing extra.
    last = jnp.take_along_axis(phys, jnp.maximum(count - 1, 0)[:, None], axis=1)
    phys = jnp.where(in_list, phys, last)
    slot_pos = None
    if slots:
        slot_ok = visible_slots(batch)  # [S, MP*ps]
        vis = jnp.take_along_axis(slot_ok.reshape(S, MP, ps), order[:, :, None], axis=1)
        pos = order[:, :, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, None, :]
        slot_pos = jnp.where(vis & in_list[:, :, None], pos, -1)

    mpp = -(-MP // pad_pages_to) * pad_pages_to
    if mpp != MP:
        phys = jnp.concatenate([phys, jnp.broadcast_to(phys[:, -1:], (S, mpp - MP))], axis=1)
        if slot_pos is not None:
            slot_pos = jnp.concatenate(
                [slot_pos, jnp.full((S, mpp - MP, ps), -1, jnp.int32)], axis=1
            )

    real = blocks.seg >= 0
    seg = jnp.maximum(blocks.seg, 0)
    bpage = page_ok[seg]  # [NB, MP]
    last_row = blocks.kv_pos + blocks.q_len - 1
    # Compacted pages are in view order, so "pages up to the last causal row" is a prefix.
    hi = jnp.sum(bpage & (page_start[None, :] <= last_row[:, None]), axis=1)
    if sliding_window is not None:
        # Pages whose last slot is before even the first row's window start are a prefix too
        # (later rows' windows start no earlier).
        first = window_start(batch, blocks.seg, blocks.kv_pos, sliding_window)
        gone = page_start[None, :] + (ps - 1) < first[:, None]
        lo = jnp.sum(bpage & gone, axis=1)
    else:
        lo = jnp.zeros_like(hi)
    lo = jnp.where(real, lo, 0).astype(jnp.int32)
    hi = jnp.where(real, jnp.maximum(hi, lo), 0).astype(jnp.int32)
    return PagePlan(pages=phys.astype(jnp.int32), order=order, slot_pos=slot_pos, lo=lo, hi=hi)


def gather_q_tiles(
    q: jax.Array, blocks: Blocks, *, rows: int, num_kv_heads: int, group_pad: int,
    head_dim_pad: int, tile_rows: int,
) -> jax.Array:
    """Query tiles ``[NB, Hkv, tile_rows, head_dim_pad]``: row ``i * group_pad + g`` is query
    row ``i`` of the block, head ``g`` of the kv head's group. Padding rows/heads/lanes are 0."""
    T, Hq, Dh = q.shape
    G = Hq // num_kv_heads
    idx = jnp.clip(blocks.q_start[:, None] + jnp.arange(rows)[None, :], 0, T - 1)
    x = q[idx].reshape(-1, rows, num_kv_heads, G, Dh)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, group_pad - G), (0, head_dim_pad - Dh)))
    x = x.transpose(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, rows * group_pad, head_dim_pad)
    if tile_rows != rows * group_pad:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, tile_rows - rows * group_pad), (0, 0)))
    return x


def scatter_out_tiles(
    o: jax.Array, blocks: Blocks, *, rows: int, group_pad: int, num_q_heads: int,
    head_dim: int, T: int, dtype,
) -> jax.Array:
    """Inverse of :func:`gather_q_tiles`: ``[NB, Hkv, tile_rows, Dp]`` -> ``[T, Hq, Dh]``.

    Rows that no block covers stay zero, as in the reference.
    """
    NB, Hkv = o.shape[:2]
    G = num_q_heads // Hkv
    x = o[:, :, : rows * group_pad].reshape(NB, Hkv, rows, group_pad, -1)[..., :G, :head_dim]
    x = x.transpose(0, 2, 1, 3, 4).reshape(NB * rows, num_q_heads, head_dim)
    r = jnp.arange(rows)[None, :]
    dst = jnp.where(r < blocks.q_len[:, None], blocks.q_start[:, None] + r, T)
    out = jnp.zeros((T, num_q_heads, head_dim), jnp.float32)
    out = out.at[dst.reshape(-1)].set(x.astype(jnp.float32), mode="drop")
    return out.astype(dtype)
