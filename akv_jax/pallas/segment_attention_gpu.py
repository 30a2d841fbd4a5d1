"""Segment-batch ragged paged attention: GPU body (Pallas, Triton lowering).

Grid ``(query block, kv head, kv split)``. A program holds one kv head's query tile: ``rows``
query rows times the (padded) GQA group, so every query head that shares the kv head reads
each key once. It walks the block's range of *visible* pages (see :mod:`plan`), a few pages
per step, with an online softmax in registers; pages no query of the segment can see were
compacted away beforehand and are never touched. Under a sliding window each tile row also
gets the smallest view index it may see (:func:`plan.window_start`: the window counts visible
slots), and pages wholly before the block's window are cut from its range like dropped ones.

Triton wants power-of-two tensor sizes and dot operands of at least 16: the GQA group and the
head dim are padded to powers of two (padded q lanes are zero; k/v are read through a block
wider than the head dim, whose extra lanes are undefined, so k's are zeroed and v's only reach
output lanes that are cut off), the tile to >= 16 rows, and small pages are gathered several
per step so a step holds >= 16 keys. Page size must be a power of two.

Split-K (``kv_splits`` > 1) runs several programs over disjoint parts of the page range, for
decode where blocks x heads alone cannot fill the GPU; the per-split partial results
(unnormalised accumulator, running max, running sum) are merged in :func:`merge_splits`,
which also adds attention sinks. The default count follows the batch (:func:`default_kv_splits`:
programs to fill the GPU), and so do the bits; with ``kv_splits=1`` (a deterministic
attention: :func:`akv_jax.pallas.dispatch.make_attention_fn`) a row's sums depend on its own
keys only, whatever the batch or the block it sits in. The reference is
:func:`akv_jax.pallas.reference.segment_attention_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from akv_jax.pallas import plan as plan_lib
from akv_jax.pallas.metadata import NEG_INF, SegmentBatch

# Split-K aims at ~4 programs per SM of the target GPU (decode streams KV: more resident
# programs hide more memory latency), with at most 64 splits. The SM count comes from the
# device (``num_cores``: 108 on an A100/A800, 132 on an H100/H200); without one, an H100's.
_PROGRAMS_PER_SM = 4
DEFAULT_NUM_CORES = 132
_MAX_SPLITS = 64


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _gpu_kernel(
    *refs,
    sm_scale: float,
    head_dim: int,
    group_pad: int,
    pages_per_step: int,
    kv_splits: int,
    sliding_window: int | None,
):
    # meta_ref   [4] int32: segment, view index of row 0, first and end compacted page
    # pages_ref  [S, MPp] int32 compacted visible pages
    # slot_ref   [S, MPp, ps] int32 view index per slot, -1 = masked
    # win_ref    [M] int32 smallest view index each tile row may see (sliding window only)
    # q_ref      [M, Dp]
    # k_ref      [P, ps, Dp] this kv head's keys (lanes >= Dh are masked loads)
    # v_ref      [P, ps, Dp]
    # acc_ref    [M, Dp] float32 unnormalised output
    # m_ref      [M] float32 running max
    # l_ref      [M] float32 running sum
    if sliding_window is None:
        meta_ref, pages_ref, slot_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref = refs
        win_ref = None
    else:
        meta_ref, pages_ref, slot_ref, win_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref = refs
    M, Dp = q_ref.shape
    ps = k_ref.shape[1]
    bk = pages_per_step * ps
    seg, kv_pos, lo, hi = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    # Steps start at multiples of pages_per_step in the segment's compacted list, not at the
    # block's lo (a window's rows move it): a key sits in the same step and lane whichever
    # block reads it, so one split sums a row alike in any batch. Pages before lo are masked.
    first = lo - lo % pages_per_step
    # This split's share of [first, hi), in whole steps.
    per_split = pl.cdiv(pl.cdiv(hi - first, kv_splits), pages_per_step) * pages_per_step
    start = first + pl.program_id(2) * per_split
    end = jnp.minimum(hi, start + per_split)
    steps = pl.cdiv(jnp.maximum(end - start, 0), pages_per_step)

    q = q_ref[...]
    # float32 in full (IEEE) precision: a GPU's default float32 dot is TF32, 10 bits of
    # mantissa, which the reference and the 1e-4 promise do not allow.
    prec = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    row_pos = kv_pos + jax.lax.broadcasted_iota(jnp.int32, (M, 1), 0) // group_pad
    if win_ref is not None:
        row_lo = win_ref[...][:, None]  # [M, 1]

    def body(i, carry):
        acc, m, lsum = carry
        idx = start + i * pages_per_step + jax.lax.broadcasted_iota(
            jnp.int32, (pages_per_step,), 0
        )
        ok = (idx >= lo) & (idx < end)
        idx = jnp.where(ok, idx, jnp.maximum(start, lo))
        phys = pages_ref[seg, idx]  # [pps]
        pos = jnp.where(ok[:, None], slot_ref[seg, idx, :], -1).reshape(1, bk)
        k = k_ref[phys].reshape(bk, Dp)
        v = v_ref[phys].reshape(bk, Dp)
        if head_dim != Dp:
            # Lanes past the head dim are out-of-bounds loads: undefined on the GPU, NaN under
            # interpret. q is zero there, but 0 * NaN is not zero.
            lane = jax.lax.broadcasted_iota(jnp.int32, (1, Dp), 1)
            k = jnp.where(lane < head_dim, k, jnp.zeros_like(k))
        s = jnp.dot(q, k.T, precision=prec, preferred_element_type=jnp.float32) * sm_scale
        mask = (pos >= 0) & (pos <= row_pos)
        if win_ref is not None:  # the window counts visible slots (see plan.window_start)
            mask &= pos >= row_lo
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        # where(), not just exp(): a row with nothing visible yet has m_new == NEG_INF.
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        lsum = alpha * lsum + p.sum(axis=1)
        # Invisible slots may hold NaN; 0 * NaN would leak through the matmul.
        v = jnp.where(pos.reshape(bk, 1) >= 0, v, jnp.zeros_like(v))
        acc = alpha[:, None] * acc + jnp.dot(
            p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32
        )
        return acc, m_new, lsum

    init = (
        jnp.zeros((M, Dp), jnp.float32),
        jnp.full((M,), NEG_INF, jnp.float32),
        jnp.zeros((M,), jnp.float32),
    )
    acc, m, lsum = jax.lax.fori_loop(0, steps, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = lsum


def merge_splits(
    acc: jax.Array, m: jax.Array, lsum: jax.Array, sinks: jax.Array | None = None
) -> jax.Array:
    """Combine split partials ``acc [K, ..., M, D]``, ``m, lsum [K, ..., M]`` into the output.

    ``sinks`` (broadcastable to ``m[0]``) is one more softmax term with no value, counted once.
    Rows that saw nothing (and no sink) come out as exact zeros.
    """
    m_all = m.max(axis=0)
    if sinks is not None:
        m_all = jnp.maximum(m_all, sinks)
    w = jnp.exp(m - m_all[None])
    denom = (w * lsum).sum(axis=0)
    if sinks is not None:
        denom = denom + jnp.exp(sinks - m_all)
    num = (w[..., None] * acc).sum(axis=0)
    return num / jnp.maximum(denom, 1e-30)[..., None]


def default_kv_splits(programs: int, max_steps: int, num_cores: int = DEFAULT_NUM_CORES) -> int:
    """Enough splits to give a GPU of ``num_cores`` SMs ~4 programs per SM, never more than
    there are steps."""
    target = _PROGRAMS_PER_SM * num_cores
    if programs >= target:
        return 1
    return max(1, min(_MAX_SPLITS, -(-target // programs), max_steps))


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_q", "sm_scale", "sliding_window", "rows_per_tile", "full_tiles", "keys_per_step",
        "kv_splits", "num_warps", "num_stages", "num_cores", "interpret",
    ),
)
def segment_attention_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    batch: SegmentBatch,
    *,
    block_q: int,
    sm_scale: float,
    sinks: jax.Array | None = None,
    sliding_window: int | None = None,
    rows_per_tile: int | None = None,
    full_tiles: bool = False,
    keys_per_step: int = 64,
    kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    num_cores: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Same contract as ``segment_attention_reference``; see the module docstring.

    ``num_cores``: the target GPU's SM count, which sizes split-K (None: an H100's 132).
    ``rows_per_tile``: query-tile rows (rows x padded group); None picks by dtype and head
    dim (see below). ``full_tiles``: every tile that many rows, padded, whatever ``block_q``
    (a decode step's one row too): a row's dots then have one shape in any batch, which
    XLA's CPU dots (interpret mode) need for the same bits; a deterministic attention."""
    T, Hq, Dh = q.shape
    P, ps, Hkv, _ = k_pages.shape
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads is not a multiple of {Hkv} kv heads")
    if ps & (ps - 1):
        raise ValueError(f"the GPU kernel needs a power-of-two page size, got {ps}")
    G = Hq // Hkv
    gp, dp = _pow2(G), max(16, _pow2(Dh))
    if rows_per_tile is None:
        # 64-row tiles, except float32 at head dim >= 128: there q, k, v and the accumulator
        # tiles need more than 255 registers a thread and spill on sm_90 (ptxas' report in a
        # deviceless compile, akv_jax.aot); 32 rows fit.
        rows_per_tile = 32 if q.dtype.itemsize >= 4 and dp >= 128 else 64
    # Query rows per tile: a power of two, so the tile (rows x padded group) is one too.
    rows = max(1, min(_pow2(block_q), rows_per_tile // gp))
    M = max(16, (max(1, rows_per_tile // gp) if full_tiles else rows) * gp)
    # Pages per step: >= 16 keys for the dot, about keys_per_step otherwise.
    pps = max(1, max(16, _pow2(keys_per_step)) // ps)

    blocks = plan_lib.split_blocks(plan_lib.blocks_of(batch), block_q, rows)
    plan = plan_lib.plan_pages(
        batch, blocks, page_size=ps, sliding_window=sliding_window, pad_pages_to=pps
    )
    NB = blocks.num_blocks
    MPp = plan.pages.shape[1]
    splits = kv_splits or default_kv_splits(
        NB * Hkv, -(-MPp // pps), num_cores or DEFAULT_NUM_CORES
    )
    meta = jnp.stack([jnp.maximum(blocks.seg, 0), blocks.kv_pos, plan.lo, plan.hi], axis=1)
    q_tiles = plan_lib.gather_q_tiles(
        q, blocks, rows=rows, num_kv_heads=Hkv, group_pad=gp, head_dim_pad=dp, tile_rows=M
    )

    whole = lambda a: pl.BlockSpec(a.shape, lambda b, h, s: (0,) * a.ndim)
    kv_spec = pl.BlockSpec((P, ps, None, dp), lambda b, h, s: (0, 0, h, 0))
    in_specs = [
        pl.BlockSpec((None, 4), lambda b, h, s: (b, 0)),
        whole(plan.pages),
        whole(plan.slot_pos),
    ]
    operands = [meta, plan.pages, plan.slot_pos]
    if sliding_window is not None:
        # Tile row i * gp + g holds query row i (padding rows repeat the last one).
        win = plan_lib.row_window_starts(batch, blocks, rows, sliding_window)
        win = win[:, jnp.minimum(jnp.arange(M) // gp, rows - 1)]  # [NB, M]
        in_specs.append(pl.BlockSpec((None, M), lambda b, h, s: (b, 0)))
        operands.append(win)
    kernel = functools.partial(
        _gpu_kernel,
        sm_scale=sm_scale,
        head_dim=Dh,
        group_pad=gp,
        pages_per_step=pps,
        kv_splits=splits,
        sliding_window=sliding_window,
    )
    acc, m, lsum = pl.pallas_call(
        kernel,
        grid=(NB, Hkv, splits),
        in_specs=[
            *in_specs,
            pl.BlockSpec((None, None, M, dp), lambda b, h, s: (b, h, 0, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, M, dp), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, M), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, M), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, NB, Hkv, M, dp), jnp.float32),
            jax.ShapeDtypeStruct((splits, NB, Hkv, M), jnp.float32),
            jax.ShapeDtypeStruct((splits, NB, Hkv, M), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="akv_segment_attention",
    )(*operands, q_tiles, k_pages, v_pages)

    sink_rows = None
    if sinks is not None:
        # Row i * gp + g of kv head h belongs to query head h * G + g.
        s = jnp.pad(sinks.astype(jnp.float32).reshape(Hkv, G), ((0, 0), (0, gp - G)))
        s = jnp.tile(s, (1, rows))
        sink_rows = jnp.pad(s, ((0, 0), (0, M - rows * gp)))[None]  # [1, Hkv, M]
    o = merge_splits(acc, m, lsum, sink_rows)
    return plan_lib.scatter_out_tiles(
        o, blocks, rows=rows, group_pad=gp, num_q_heads=Hq, head_dim=Dh, T=T, dtype=q.dtype
    )
