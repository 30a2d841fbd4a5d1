"""Segment-batch ragged paged attention: TPU body (Pallas, Mosaic lowering).

The grid is a flat *work list*: one step per (query block, visible page) pair, blocks in
order, pages of a block in view order, and its length is dynamic (the number of pairs), so an
invisible page costs neither a DMA nor a grid step. Everything the index maps need sits in
SMEM through scalar prefetch:

* ``work``: per step, ``block << 16 | compacted page index``;
* ``blk``: per block, (segment, view index of row 0, first and end compacted page);
* ``pages``: per segment, its compacted visible physical pages (see :mod:`plan`).

The page's keys and values for *all* kv heads arrive as one contiguous block
``[page_size, Hkv, Dh]`` (BlockSpec pipelining double-buffers it), and each kv head's query
tile (the block's rows times its GQA group; blocks are cut so a tile stays within
``max_tile_rows``) is scored against its lane slice. The online
softmax state lives in VMEM scratch across the steps of a block; the output block is written
on the block's last step. A block with no visible page still gets one (fully masked) step, so
its output is written (as zeros). Under a sliding window each tile row also gets the smallest
view index it may see (a per-block ``[M, 1]`` input; :func:`plan.window_start`: the window
counts visible slots), and pages wholly before the block's window are not in its work list.
Attention sinks start the running max/sum (an extra softmax term with no value), so nothing is
left to merge outside the kernel.

Pages of 64-128 tokens amortise the per-step cost. The work list is sized for the worst case
(blocks x pages words of SMEM); batches past :data:`SMEM_BUDGET` are refused with a message,
to be split by the caller. The reference is
:func:`akv_jax.pallas.reference.segment_attention_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from akv_jax.pallas import plan as plan_lib
from akv_jax.pallas.metadata import NEG_INF, SegmentBatch

_LANES = 128
# Scalar prefetch lives in SMEM (1 MiB per core up to v6e); the work list is sized for the
# worst case, every block reading every page (blocks x pages words).
SMEM_BUDGET = 768 << 10


def _tpu_kernel(
    *refs,
    sm_scale: float,
    sliding_window: int | None,
    has_sinks: bool,
):
    # scalar prefetch (SMEM)
    #   work_ref     [W] int32 block << 16 | compacted page index
    #   blk_ref      [NB * 4] int32 segment, kv_pos, lo, hi
    #   pages_ref    [S * MPp] int32 (used by the index maps only)
    # inputs (VMEM blocks)
    #   row_off_ref  [M, 1] int32 query row of each tile row
    #   win_ref      [M, 1] int32 smallest view index each tile row may see (window only)
    #   sinks_ref    [Hkv, M, 128] float32 initial running max (sink logit or NEG_INF)
    #   q_ref        [Hkv, M, Dh]
    #   k_ref        [ps, Hkv, Dh] the step's page, all kv heads
    #   v_ref        [ps, Hkv, Dh]
    #   pos_ref      [8, ps] int32 view index per slot (-1 = masked) of 8 consecutive pages
    # output
    #   o_ref        [Hkv, M, Dh]
    # scratch
    #   m_ref        [Hkv, M, 128] float32, lane-replicated
    #   l_ref        [Hkv, M, 128] float32
    #   acc_ref      [Hkv, M, Dh] float32
    if sliding_window is None:
        (work_ref, blk_ref, _, row_off_ref, sinks_ref, q_ref, k_ref, v_ref, pos_ref, o_ref,
         m_ref, l_ref, acc_ref) = refs
        win_ref = None
    else:
        (work_ref, blk_ref, _, row_off_ref, win_ref, sinks_ref, q_ref, k_ref, v_ref, pos_ref,
         o_ref, m_ref, l_ref, acc_ref) = refs
    hkv, M, _ = q_ref.shape
    w = work_ref[pl.program_id(0)]
    b, i = w >> 16, w & 0xFFFF
    kv_pos, lo, hi = blk_ref[4 * b + 1], blk_ref[4 * b + 2], blk_ref[4 * b + 3]

    @pl.when(i == lo)
    def _init():
        m_ref[...] = sinks_ref[...]
        l_ref[...] = jnp.full(l_ref.shape, 1.0 if has_sinks else 0.0, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(i < hi)
    def _step():
        ps = pos_ref.shape[1]
        row_pos = kv_pos + row_off_ref[...]  # [M, 1]
        # This page's row of the 8-page block (pages of a segment are padded to 8, so the
        # block never straddles segments): a one-hot sum instead of a dynamic sublane slice.
        sub = jax.lax.broadcasted_iota(jnp.int32, pos_ref.shape, 0)
        pos = jnp.sum(jnp.where(sub == (i & 7), pos_ref[...], 0), axis=0, keepdims=True)  # [1, ps]
        mask = (pos >= 0) & (pos <= row_pos)
        if win_ref is not None:  # the window counts visible slots (see plan.window_start)
            mask &= pos >= win_ref[...]
        # The same visibility as a column (to zero invisible values): transpose through the
        # diagonal, which needs no relayout.
        eye = jax.lax.broadcasted_iota(jnp.int32, (ps, ps), 0) == jax.lax.broadcasted_iota(
            jnp.int32, (ps, ps), 1
        )
        v_ok = jnp.max(jnp.where(eye, pos, -1), axis=1, keepdims=True) >= 0  # [ps, 1]
        f32 = q_ref.dtype == jnp.float32
        prec = jax.lax.Precision.HIGHEST if f32 else None
        for h in range(hkv):  # static: one MXU pass per kv head
            q = q_ref[h]
            k = k_ref[:, h, :]
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=prec,
                preferred_element_type=jnp.float32,
            ) * sm_scale
            s = jnp.where(mask, s, NEG_INF)
            m_prev = jnp.max(m_ref[h], axis=1, keepdims=True)  # [M, 1] (lanes are equal)
            l_prev = jnp.max(l_ref[h], axis=1, keepdims=True)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
            l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_ref[h] = jnp.broadcast_to(m_next, (M, _LANES))
            l_ref[h] = jnp.broadcast_to(l_next, (M, _LANES))
            # Invisible slots may hold NaN; 0 * NaN would leak through the matmul.
            v = v_ref[:, h, :]
            v = jnp.where(v_ok, v, jnp.zeros_like(v))
            pv = jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
            acc_ref[h] = alpha * acc_ref[h] + pv

    @pl.when(i >= hi - 1)
    def _finish():
        for h in range(hkv):
            lsum = jnp.max(l_ref[h], axis=1, keepdims=True)
            o_ref[h] = (acc_ref[h] / jnp.maximum(lsum, 1e-30)).astype(o_ref.dtype)


def build_work_list(blocks: plan_lib.Blocks, lo: jax.Array, hi: jax.Array, max_work: int):
    """``(work [max_work], count)``: (block, page) pairs in block order, padded at the end.

    Real blocks get ``max(hi - lo, 1)`` steps; padding blocks none (their rows are dropped).
    """
    n = jnp.where(blocks.seg >= 0, jnp.maximum(hi - lo, 1), 0).astype(jnp.int32)
    cum = jnp.cumsum(n)
    w = jnp.arange(max_work, dtype=jnp.int32)
    b = jnp.searchsorted(cum, w, side="right").astype(jnp.int32)
    b = jnp.minimum(b, blocks.num_blocks - 1)
    i = lo[b] + w - (cum[b] - n[b])
    # Steps past the end repeat the last real one: same blocks, so no DMA if ever run.
    last = jnp.maximum(cum[-1] - 1, 0)
    b = jnp.where(w < cum[-1], b, b[last])
    i = jnp.where(w < cum[-1], i, i[last])
    return (b << 16) | i, cum[-1]


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_q", "sm_scale", "sliding_window", "max_tile_rows", "vmem_limit_bytes", "interpret"
    ),
)
def segment_attention_tpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    batch: SegmentBatch,
    *,
    block_q: int,
    sm_scale: float,
    sinks: jax.Array | None = None,
    sliding_window: int | None = None,
    max_tile_rows: int = 256,
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Same contract as ``segment_attention_reference``; see the module docstring.

    ``max_tile_rows``: query blocks whose tile (rows x GQA group) would exceed it are cut
    into smaller blocks, which bounds VMEM (the accumulators are ``Hkv x tile`` float32).
    ``vmem_limit_bytes``: None estimates what the kernel needs.
    """
    T, Hq, Dh = q.shape
    P, ps, Hkv, _ = k_pages.shape
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads is not a multiple of {Hkv} kv heads")
    G = Hq // Hkv
    rows = block_q if block_q * G <= max_tile_rows else max(1, max_tile_rows // G)
    sub = 16 if q.dtype.itemsize < 4 else 8  # sublane tile
    M = -(-rows * G // sub) * sub

    blocks = plan_lib.split_blocks(plan_lib.blocks_of(batch), block_q, rows)
    plan = plan_lib.plan_pages(
        batch, blocks, page_size=ps, sliding_window=sliding_window, pad_pages_to=8
    )
    NB = blocks.num_blocks
    S, MPp = plan.pages.shape
    if NB >= 1 << 15 or MPp >= 1 << 16:
        raise ValueError(f"work-list packing needs < 32768 blocks and < 65536 pages: {NB}, {MPp}")
    smem = 4 * (NB * MPp + S * MPp + 4 * NB)
    if smem > SMEM_BUDGET and not interpret:
        raise ValueError(
            f"segment batch needs {smem >> 10} KiB of SMEM for its work list (budget "
            f"{SMEM_BUDGET >> 10} KiB): split it into several calls, or use larger pages"
        )
    work, count = build_work_list(blocks, plan.lo, plan.hi, NB * MPp)
    blk = jnp.stack([jnp.maximum(blocks.seg, 0), blocks.kv_pos, plan.lo, plan.hi], axis=1)
    pages_flat = plan.pages.reshape(-1)

    q_tiles = plan_lib.gather_q_tiles(
        q, blocks, rows=rows, num_kv_heads=Hkv, group_pad=G, head_dim_pad=Dh, tile_rows=M
    )
    row_off = jnp.minimum(jnp.arange(M, dtype=jnp.int32) // G, rows - 1)[:, None]
    if sinks is None:
        sink_rows = jnp.full((Hkv, M), NEG_INF, jnp.float32)
    else:
        s = jnp.tile(sinks.astype(jnp.float32).reshape(Hkv, G), (1, rows))
        sink_rows = jnp.pad(s, ((0, 0), (0, M - rows * G)))
    sink_rows = jnp.broadcast_to(sink_rows[:, :, None], (Hkv, M, _LANES))
    # [pages / 8, 8, ps]: an (8, ps) block is a legal, densely tiled TPU block.
    pos_groups = plan.slot_pos.reshape(S * MPp // 8, 8, ps)

    def decode(w, work_ref, blk_ref):
        word = work_ref[w]
        b, i = word >> 16, word & 0xFFFF
        return b, blk_ref[4 * b] * MPp + jnp.minimum(i, MPp - 1)

    def q_map(w, work_ref, blk_ref, pages_ref):
        return decode(w, work_ref, blk_ref)[0], 0, 0, 0

    def kv_map(w, work_ref, blk_ref, pages_ref):
        return pages_ref[decode(w, work_ref, blk_ref)[1]], 0, 0, 0

    def slot_map(w, work_ref, blk_ref, pages_ref):
        return decode(w, work_ref, blk_ref)[1] >> 3, 0, 0  # shifts: no sign fix-ups

    extra_specs, extra = [], []
    if sliding_window is not None:
        win = plan_lib.row_window_starts(batch, blocks, rows, sliding_window)
        extra.append(win[:, row_off[:, 0]][:, :, None])  # [NB, M, 1]
        extra_specs.append(
            pl.BlockSpec((None, M, 1), lambda *a: q_map(*a)[:3])
        )

    if vmem_limit_bytes is None:
        item = q.dtype.itemsize
        need = (
            3 * Hkv * M * max(Dh, _LANES) * 4  # m, l, acc scratch
            + 2 * Hkv * M * _LANES * 4  # sinks (double-buffered)
            + 2 * 2 * Hkv * M * Dh * item  # q and out blocks
            + 2 * 2 * ps * Hkv * Dh * k_pages.dtype.itemsize  # k and v pages
            + 2 * (8 * ps + 2 * M * _LANES) * 4  # slot positions, row offsets, window
        )
        # Above the 16 MiB default scoped limit, ask for what is needed (with slack).
        vmem_limit_bytes = None if need < 12 << 20 else min(int(need * 1.5), 100 << 20)
    const = lambda nd: (lambda w, *_: (0,) * nd)
    # The pool's own layout: a [P, ps, Hkv * Dh] view would be free in row-major memory but a
    # relayout copy of the whole pool under TPU tiling of the (Hkv, Dh) minor dims.
    kv_spec = pl.BlockSpec((None, ps, Hkv, Dh), kv_map)
    kernel = functools.partial(
        _tpu_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
        has_sinks=sinks is not None,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(count,),
            in_specs=[
                pl.BlockSpec((M, 1), const(2)),
                *extra_specs,
                pl.BlockSpec((Hkv, M, _LANES), const(3)),
                pl.BlockSpec((None, Hkv, M, Dh), q_map),
                kv_spec,
                kv_spec,
                pl.BlockSpec((None, 8, ps), slot_map),
            ],
            out_specs=pl.BlockSpec((None, Hkv, M, Dh), q_map),
            scratch_shapes=[
                pltpu.VMEM((Hkv, M, _LANES), jnp.float32),
                pltpu.VMEM((Hkv, M, _LANES), jnp.float32),
                pltpu.VMEM((Hkv, M, Dh), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((NB, Hkv, M, Dh), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret,
        name="akv_segment_attention",
    )(
        work, blk.reshape(-1), pages_flat, row_off, *extra, sink_rows, q_tiles, k_pages, v_pages,
        pos_groups,
    )
    return plan_lib.scatter_out_tiles(
        out, blocks, rows=rows, group_pad=G, num_q_heads=Hq, head_dim=Dh, T=T, dtype=q.dtype
    )
