"""Segment-batch attention in plain jnp whose work follows the visible KV: the CPU fast path.

The reference (reference.py) is written for clarity: every query block scores its whole
view, masked. This version reads, for each block, only the compacted run of visible pages
that :func:`akv_jax.pallas.plan.plan_pages` gives it (dropped pages and pages past the causal
end are never touched), ``pages_per_chunk`` pages per step of a ``fori_loop`` with a dynamic
trip count, with an online softmax. Same semantics as the reference (tests compare them);
``--attention-backend auto`` uses it on the CPU, where there is no Pallas lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from akv_jax.pallas.metadata import NEG_INF, SegmentBatch
from akv_jax.pallas.plan import blocks_of, plan_pages, row_window_starts

# Keys per loop step. Each step costs a fixed overhead on the CPU; 512 keys keep it small next
# to the work (measured: cold 20K-token prefills ~1.4x faster than with 128), at the price of
# up to one partly used chunk per query block.
CHUNK_KEYS = 512


def _default_pages_per_chunk(page_size: int) -> int:
    return max(1, CHUNK_KEYS // page_size)


def _pages(pool: jax.Array, layer: jax.Array | None, pages: jax.Array) -> jax.Array:
    return pool[pages] if layer is None else pool[layer, pages]


def segment_attention_chunked(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    batch: SegmentBatch,
    *,
    block_q: int,
    sm_scale: float,
    sinks: jax.Array | None = None,
    sliding_window: int | None = None,
    pages_per_chunk: int | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """``layer`` given: ``k_pages``/``v_pages`` hold every layer [L, P, ps, Hkv, Dh] and the
    chunks are gathered from that layer in place (no per-layer copy of the pool)."""
    T, Hq, Dh = q.shape
    ps, Hkv = k_pages.shape[-3], k_pages.shape[-2]
    G = Hq // Hkv
    C = pages_per_chunk or _default_pages_per_chunk(ps)
    blocks = blocks_of(batch)
    plan = plan_pages(batch, blocks, page_size=ps, sliding_window=sliding_window)
    if sliding_window is not None:  # [NB, block_q] smallest view index each row may see
        win = row_window_starts(batch, blocks, block_q, sliding_window)
    # One spare chunk of padding so a chunk starting anywhere below ``hi`` never runs past the
    # end (dynamic_slice would clamp the start and shift the window).
    pages = jnp.concatenate([plan.pages, jnp.repeat(plan.pages[:, -1:], C, axis=1)], axis=1)
    slot_pos = jnp.concatenate(
        [plan.slot_pos, jnp.full((plan.slot_pos.shape[0], C, ps), -1, jnp.int32)], axis=1
    )
    q_pad = jnp.concatenate([q, jnp.zeros((block_q, Hq, Dh), q.dtype)], axis=0)
    rows = jnp.arange(block_q)

    def one_block(b):
        seg = jnp.maximum(blocks.seg[b], 0)
        qb = jax.lax.dynamic_slice_in_dim(q_pad, blocks.q_start[b], block_q, axis=0)
        qb = qb.reshape(block_q, Hkv, G, Dh).astype(jnp.float32) * sm_scale
        causal = blocks.kv_pos[b] + rows
        row_ok = rows < blocks.q_len[b]
        lo, hi = plan.lo[b], plan.hi[b]

        def chunk(i, carry):
            m, denom, acc = carry
            start = lo + i * C
            pg = jax.lax.dynamic_slice_in_dim(pages[seg], start, C)
            sp = jax.lax.dynamic_slice_in_dim(slot_pos[seg], start, C)
            in_range = (start + jnp.arange(C)) < hi
            sp = jnp.where(in_range[:, None], sp, -1).reshape(C * ps)
            ok = sp >= 0
            k = _pages(k_pages, layer, pg).reshape(C * ps, Hkv, Dh).astype(jnp.float32)
            v = _pages(v_pages, layer, pg).reshape(C * ps, Hkv, Dh).astype(jnp.float32)
            v = jnp.where(ok[:, None, None], v, 0.0)  # masked slots may hold NaN
            mask = ok[None, :] & (sp[None, :] <= causal[:, None]) & row_ok[:, None]
            if sliding_window is not None:  # the window counts visible slots (plan.py)
                mask &= sp[None, :] >= win[b][:, None]
            s = jnp.einsum("qhgd,khd->hgqk", qb, k)
            s = jnp.where(mask[None, None], s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1))
            # No second select over the [heads, rows, keys] scores (on the CPU the two
            # selects cost as much as both matmuls): a masked score is NEG_INF, so its
            # exp is exactly 0 once the row maximum is floored at NEG_INF / 10 (a row with
            # nothing visible yet); a row with a visible score keeps its own maximum.
            p = jnp.exp(s - jnp.maximum(m_new, NEG_INF / 10)[..., None])
            corr = jnp.exp(m - m_new)
            denom = denom * corr + p.sum(axis=-1)
            acc = acc * corr[..., None] + jnp.einsum("hgqk,khd->hgqd", p, v)
            return m_new, denom, acc

        shape = (Hkv, G, block_q)
        if sinks is None:
            m0, l0 = jnp.full(shape, NEG_INF), jnp.zeros(shape)
        else:  # a sink is one extra logit with no value: it starts the running softmax
            m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(Hkv, G, 1), shape)
            l0 = jnp.ones(shape)
        acc0 = jnp.zeros((*shape, Dh))
        n_chunks = (hi - lo + C - 1) // C
        _, denom, acc = jax.lax.fori_loop(0, n_chunks, chunk, (m0, l0, acc0))
        o = acc / jnp.maximum(denom, 1e-30)[..., None]
        return o.transpose(2, 0, 1, 3).reshape(block_q, Hq, Dh)

    out_blocks = jax.lax.map(one_block, jnp.arange(blocks.num_blocks))
    out_rows = blocks.q_start[:, None] + rows[None, :]
    out_rows = jnp.where(rows[None, :] < blocks.q_len[:, None], out_rows, T)
    out = jnp.zeros((T, Hq, Dh), jnp.float32)
    out = out.at[out_rows.reshape(-1)].set(out_blocks.reshape(-1, Hq, Dh), mode="drop")
    return out.astype(q.dtype)
