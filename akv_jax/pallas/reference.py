"""jnp references for the two kernels: segment-batch paged attention and repos.

These define the semantics the Pallas kernels must reproduce, and they are the attention
path on the CPU. Written for clarity over speed, but they still run one query block at a
time (``lax.map``) so memory stays O(block x view), not O(tokens x view).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from akv_jax.pallas.metadata import NEG_INF, SegmentBatch
from akv_jax.pallas.rotary import RopeTable, rerotate


def segment_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    batch: SegmentBatch,
    *,
    block_q: int,
    sm_scale: float,
    sinks: jax.Array | None = None,
    sliding_window: int | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Attention of every query block over its segment's paged view.

    Args:
      q: [T, Hq, Dh] queries, already rotated to their positions.
      k_pages, v_pages: [P, page_size, Hkv, Dh] key/value pool (keys already rotated).
      batch: the segment batch metadata.
      block_q: rows per query block (static; the metadata was built with it).
      sm_scale: softmax scale.
      sinks: optional [Hq] per-head sink logits (GPT-OSS): an extra softmax term with no value.
      sliding_window: optional window W counted in *visible* slots (DESIGN §2.1): the row at
        view index c sees the W most recent visible slots at or before c, itself included
        (invisible slots take no room, so after a drop the window reaches further back; with
        every slot visible this is c - W < j <= c).
      layer: when given, k_pages/v_pages hold every layer [L, P, ...] and this one is used.

    Returns:
      [T, Hq, Dh] in q's dtype; rows no block covers are zero.
    """
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    T, Hq, Dh = q.shape
    _, page_size, Hkv, _ = k_pages.shape
    G = Hq // Hkv
    MP = batch.page_table.shape[1]
    q_pad = jnp.concatenate([q, jnp.zeros((block_q, Hq, Dh), q.dtype)], axis=0)

    def one_block(b):
        seg = jnp.maximum(batch.block_seg[b], 0)
        q_start, q_len = batch.block_q_start[b], batch.block_q_len[b]
        qb = jax.lax.dynamic_slice_in_dim(q_pad, q_start, block_q, axis=0)
        qb = qb.reshape(block_q, Hkv, G, Dh).astype(jnp.float32)
        pages = batch.page_table[seg]
        k = k_pages[pages].reshape(MP * page_size, Hkv, Dh).astype(jnp.float32)
        v = v_pages[pages].reshape(MP * page_size, Hkv, Dh).astype(jnp.float32)
        kv_idx = jnp.arange(MP * page_size)
        visible = batch.kv_visible[seg] & (kv_idx < batch.kv_len[seg])
        rows = jnp.arange(block_q)
        causal_idx = batch.block_kv_pos[b] + rows
        mask = visible[None, :] & (kv_idx[None, :] <= causal_idx[:, None])
        mask &= (rows < q_len)[:, None]
        if sliding_window is not None:
            # rank[j]: visible slots in [0, j]. Slot j is among the W most recent visible slots
            # at or before c iff rank[c] - rank[j] < W.
            rank = jnp.cumsum(visible, dtype=jnp.int32)
            rank_c = rank[jnp.clip(causal_idx, 0, MP * page_size - 1)]
            mask &= rank[None, :] > rank_c[:, None] - sliding_window
        # Invisible slots may hold anything (NaN included): never let them reach the sums.
        v = jnp.where(visible[:, None, None], v, 0.0)
        s = jnp.einsum("qhgd,khd->hgqk", qb, k) * sm_scale
        s = jnp.where(mask[None, None], s, NEG_INF)
        m = s.max(axis=-1, keepdims=True)
        if sinks is not None:
            sk = sinks.astype(jnp.float32).reshape(Hkv, G, 1, 1)
            m = jnp.maximum(m, sk)
        p = jnp.where(mask[None, None], jnp.exp(s - m), 0.0)
        denom = p.sum(axis=-1, keepdims=True)
        if sinks is not None:
            denom = denom + jnp.exp(sk - m)
        o = jnp.einsum("hgqk,khd->qhgd", p, v) / jnp.maximum(denom, 1e-30).transpose(2, 0, 1, 3)
        return o.reshape(block_q, Hq, Dh)

    out_blocks = jax.lax.map(one_block, jnp.arange(batch.block_seg.shape[0]))
    # Scatter block rows back to their query rows; padding rows go out of range and drop.
    rows = batch.block_q_start[:, None] + jnp.arange(block_q)[None, :]
    rows = jnp.where(jnp.arange(block_q)[None, :] < batch.block_q_len[:, None], rows, T)
    out = jnp.zeros((T, Hq, Dh), jnp.float32)
    out = out.at[rows.reshape(-1)].set(out_blocks.reshape(-1, Hq, Dh), mode="drop")
    return out.astype(q.dtype)


def repos_reference(
    k_pages: jax.Array,
    pages: jax.Array,
    old_pos: jax.Array,
    new_pos: jax.Array,
    table: RopeTable,
) -> jax.Array:
    """Re-rotate the keys of the listed pages: ``K' = R(new) R(old)^-1 K``.

    Args:
      k_pages: [P, page_size, Hkv, Dh] keys.
      pages: [N] page ids to rotate (entries >= P are padding and ignored).
      old_pos, new_pos: [N, page_size] int32 positions of each slot of those pages.

    Returns the new key pool; pages not listed are returned unchanged (bit-identical).
    """
    P, page_size, Hkv, Dh = k_pages.shape
    valid = pages < P
    safe = jnp.where(valid, pages, 0)
    k = k_pages[safe]  # [N, ps, Hkv, Dh]
    rot = rerotate(k.reshape(-1, Hkv, Dh), old_pos.reshape(-1), new_pos.reshape(-1), table).reshape(
        k.shape
    )
    return k_pages.at[jnp.where(valid, pages, P)].set(rot, mode="drop")
