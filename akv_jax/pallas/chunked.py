"""Segment-batch attention in plain jnp whose work follows the visible KV: the CPU fallback.

The reference (reference.py) is written for clarity: every query block scores its whole
view, masked. This version reads, for each block, only the compacted run of visible pages
that :func:`akv_jax.pallas.plan.plan_pages` gives it (dropped pages and pages past the causal
end are never touched), ``pages_per_chunk`` pages per step of a ``fori_loop`` with a dynamic
trip count, with an online softmax. Same semantics as the reference (tests compare them);
``--attention-backend auto`` uses it on the CPU where the fused C++ kernel
(segment_attention_cpu.py) cannot run: no compiler, not float32, or a tensor-parallel mesh.

Two loops over the same plan, chosen by ``block_q`` (static):

* decode (``block_q == 1``): each block (one request's token) gathers its chunk of pages
  from the pool inside the loop; every key is read once, which is all a decode step does;
* prefill and restore (``block_q > 1``): many blocks read the same view, so a loop over
  segments gathers each one's compacted visible pages, as far as its blocks reach, into a
  head-major buffer ``[Hkv, keys, Dh]``, and its blocks slice their chunks out of it. The
  scores are then one batched matmul per kv head over ``group x block_q`` query rows, with
  no gather or transpose inside the chunk loop (figures: ``docs/cpu-kernels.md``).

Both run the same online softmax (:func:`_softmax_step`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from akv_jax.pallas.metadata import NEG_INF, SegmentBatch
from akv_jax.pallas.plan import blocks_of, plan_pages, row_window_starts

# Keys per loop step. Each step costs a fixed overhead on the CPU; 512 keys keep it small next
# to the work, at the price of up to one partly used chunk per query block.
CHUNK_KEYS = 512


def _default_pages_per_chunk(page_size: int) -> int:
    return max(1, CHUNK_KEYS // page_size)


def _pages(pool: jax.Array, layer: jax.Array | None, pages: jax.Array) -> jax.Array:
    return pool[pages] if layer is None else pool[layer, pages]


# The online softmax both loops run, per query block, over [Hkv, G, block_q] rows: a carry
# (running maximum, denominator, [..., Dh] accumulator) updated chunk by chunk.
def _softmax_start(sinks: jax.Array | None, Hkv: int, G: int, rows: int, Dh: int):
    shape = (Hkv, G, rows)
    if sinks is None:
        m0, l0 = jnp.full(shape, NEG_INF), jnp.zeros(shape)
    else:  # a sink is one extra logit with no value: it starts the running softmax
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(Hkv, G, 1), shape)
        l0 = jnp.ones(shape)
    return m0, l0, jnp.zeros((*shape, Dh))


def _softmax_step(carry, s: jax.Array, mask: jax.Array, pv):
    """One chunk: scores ``s`` [Hkv, G, rows, keys], ``mask`` [rows, keys], ``pv(p)`` the
    chunk's probabilities times its values, [Hkv, G, rows, Dh]."""
    m, denom, acc = carry
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=-1))
    # No second select over the [heads, rows, keys] scores (on the CPU the two selects cost
    # as much as both matmuls): a masked score is NEG_INF, so its exp is exactly 0 once the
    # row maximum is floored at NEG_INF / 10 (a row with nothing visible yet); a row with a
    # visible score keeps its own maximum.
    p = jnp.exp(s - jnp.maximum(m_new, NEG_INF / 10)[..., None])
    corr = jnp.exp(m - m_new)
    return m_new, denom * corr + p.sum(axis=-1), acc * corr[..., None] + pv(p)


def _softmax_out(carry) -> jax.Array:
    """The block's output rows [rows, Hkv * G, Dh]."""
    _, denom, acc = carry
    o = acc / jnp.maximum(denom, 1e-30)[..., None]
    Hkv, G, rows, Dh = o.shape
    return o.transpose(2, 0, 1, 3).reshape(rows, Hkv * G, Dh)


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
    if block_q > 1:
        return _attention_over_gathered_views(
            q, k_pages, v_pages, batch, block_q=block_q, sm_scale=sm_scale, sinks=sinks,
            sliding_window=sliding_window, pages_per_chunk=pages_per_chunk, layer=layer,
        )
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
            return _softmax_step(carry, s, mask, lambda p: jnp.einsum("hgqk,khd->hgqd", p, v))

        n_chunks = (hi - lo + C - 1) // C
        carry = jax.lax.fori_loop(0, n_chunks, chunk, _softmax_start(sinks, Hkv, G, block_q, Dh))
        return _softmax_out(carry)

    out_blocks = jax.lax.map(one_block, jnp.arange(blocks.num_blocks))
    out_rows = blocks.q_start[:, None] + rows[None, :]
    out_rows = jnp.where(rows[None, :] < blocks.q_len[:, None], out_rows, T)
    out = jnp.zeros((T, Hq, Dh), jnp.float32)
    out = out.at[out_rows.reshape(-1)].set(out_blocks.reshape(-1, Hq, Dh), mode="drop")
    return out.astype(q.dtype)


def _attention_over_gathered_views(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    batch: SegmentBatch,
    *,
    block_q: int,
    sm_scale: float,
    sinks: jax.Array | None,
    sliding_window: int | None,
    pages_per_chunk: int | None,
    layer: jax.Array | None,
) -> jax.Array:
    """:func:`segment_attention_chunked` for blocks of many rows (see the module docstring).

    A loop over segments; each gathers its visible pages, only as many chunks as its blocks
    reach (padding segments and the padding of a view bucket gather nothing), then loops over
    its own blocks with the same online softmax.
    """
    T, Hq, Dh = q.shape
    ps, Hkv = k_pages.shape[-3], k_pages.shape[-2]
    G = Hq // Hkv
    C = pages_per_chunk or _default_pages_per_chunk(ps)
    CK = C * ps  # keys per loop step
    blocks = blocks_of(batch)
    S = batch.page_table.shape[0]
    plan = plan_pages(batch, blocks, page_size=ps, sliding_window=sliding_window,
                      pad_pages_to=C)
    if sliding_window is not None:  # [NB, block_q] smallest view index each row may see
        win = row_window_starts(batch, blocks, block_q, sliding_window)
    # One spare chunk past the compacted view (never gathered, all masked), so a chunk that
    # starts below ``hi`` never runs past the end (dynamic_slice would clamp its start and
    # shift it over keys an earlier chunk already counted).
    n = (plan.pages.shape[1] + C) * ps
    slot_pos = jnp.concatenate(
        [plan.slot_pos, jnp.full((S, C, ps), -1, jnp.int32)], axis=1
    ).reshape(S, n)
    real = blocks.seg >= 0
    seg_of = jnp.where(real, blocks.seg, S)  # padding blocks -> out of range (dropped)
    reach = jnp.zeros((S,), jnp.int32).at[seg_of].max(plan.hi, mode="drop")  # pages
    # Block ids grouped by segment (stable: each segment's blocks in their order).
    by_seg = jnp.argsort(seg_of, stable=True).astype(jnp.int32)
    count = jnp.zeros((S,), jnp.int32).at[seg_of].add(1, mode="drop")
    first = jnp.cumsum(count) - count  # segment s's blocks: by_seg[first[s] : + count[s]]
    q_pad = jnp.concatenate([q, jnp.zeros((block_q, Hq, Dh), q.dtype)], axis=0)
    rows = jnp.arange(block_q)

    def one_segment(s, carry):
        # [Hkv, n, Dh]: the segment's keys in slot order per kv head, so a chunk is one
        # contiguous slice and the score matmul needs no transpose. Filled up to ``reach``;
        # past it the buffers hold an earlier segment's (finite) keys, which the blocks never
        # see unmasked: their slot positions come from this segment's ``slot_pos``.
        out, k, v = carry

        def gather(i, kv):
            kb, vb = kv
            pg = jax.lax.dynamic_slice(plan.pages, (s, i * C), (1, C))[0]
            sp = jax.lax.dynamic_slice(slot_pos, (s, i * CK), (1, CK))[0]
            kc = _pages(k_pages, layer, pg).reshape(CK, Hkv, Dh).astype(jnp.float32)
            vc = _pages(v_pages, layer, pg).reshape(CK, Hkv, Dh).astype(jnp.float32)
            vc = jnp.where((sp >= 0)[:, None, None], vc, 0.0)  # masked slots may hold NaN
            kb = jax.lax.dynamic_update_slice(kb, kc.transpose(1, 0, 2), (0, i * CK, 0))
            vb = jax.lax.dynamic_update_slice(vb, vc.transpose(1, 0, 2), (0, i * CK, 0))
            return kb, vb

        k, v = jax.lax.fori_loop(0, (reach[s] + C - 1) // C, gather, (k, v))
        sp_seg = slot_pos[s]

        def one_block(j, out):
            b = by_seg[first[s] + j]
            qb = jax.lax.dynamic_slice_in_dim(q_pad, blocks.q_start[b], block_q, axis=0)
            # [Hkv, G * block_q, Dh]: row g * block_q + i is query row i, head g.
            qb = qb.reshape(block_q, Hkv, G, Dh).astype(jnp.float32) * sm_scale
            qb = qb.transpose(1, 2, 0, 3).reshape(Hkv, G * block_q, Dh)
            causal = blocks.kv_pos[b] + rows
            row_ok = rows < blocks.q_len[b]
            lo, hi = plan.lo[b] * ps, plan.hi[b] * ps

            def chunk(i, carry):
                start = lo + i * CK
                kc = jax.lax.dynamic_slice_in_dim(k, start, CK, axis=1)
                vc = jax.lax.dynamic_slice_in_dim(v, start, CK, axis=1)
                sp = jax.lax.dynamic_slice_in_dim(sp_seg, start, CK)
                mask = (sp[None, :] >= 0) & (sp[None, :] <= causal[:, None]) & row_ok[:, None]
                if sliding_window is not None:  # the window counts visible slots (plan.py)
                    mask &= sp[None, :] >= win[b][:, None]
                s_ = jnp.einsum("hqd,hkd->hqk", qb, kc).reshape(Hkv, G, block_q, CK)

                def pv(p):
                    o = jnp.einsum("hqk,hkd->hqd", p.reshape(Hkv, G * block_q, CK), vc)
                    return o.reshape(Hkv, G, block_q, Dh)

                return _softmax_step(carry, s_, mask, pv)

            n_chunks = (hi - lo + CK - 1) // CK
            carry = jax.lax.fori_loop(0, n_chunks, chunk,
                                      _softmax_start(sinks, Hkv, G, block_q, Dh))
            o = _softmax_out(carry)
            # Rows past q_len belong to whatever follows: keep what is there.
            old = jax.lax.dynamic_slice_in_dim(out, blocks.q_start[b], block_q, axis=0)
            o = jnp.where(row_ok[:, None, None], o, old)
            return jax.lax.dynamic_update_slice_in_dim(out, o, blocks.q_start[b], axis=0)

        return jax.lax.fori_loop(0, count[s], one_block, out), k, v

    out = jnp.zeros((T + block_q, Hq, Dh), jnp.float32)
    empty = jnp.zeros((Hkv, n, Dh), jnp.float32)
    # Segments past the last one with a block (the padding) have nothing to do.
    n_real = jnp.max(jnp.where(real, blocks.seg, -1)) + 1
    out, _, _ = jax.lax.fori_loop(0, n_real, one_segment, (out, empty, empty))
    return out[:T].astype(q.dtype)
