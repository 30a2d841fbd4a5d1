"""Segment-batch attention on the CPU through the fused C++ kernel
(:mod:`akv_jax.kernels.cpu.attention`): this module turns a segment batch into the page plan
the kernel reads, as the GPU and TPU entries do for their Pallas kernels. The attention
factory (:mod:`akv_jax.pallas.dispatch`) picks it for ``--attention-backend auto`` on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from akv_jax.kernels.cpu.attention import attend, available, supports
from akv_jax.pallas.metadata import SegmentBatch
from akv_jax.pallas.plan import blocks_of, plan_pages, row_window_starts

__all__ = ["available", "segment_attention_cpu", "supports"]  # the kernel's checks, for callers


def segment_attention_cpu(
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
    """Attention of ``q`` [T, Hq, Dh] over the paged pools ([P, ps, Hkv, Dh], or every layer
    [L, P, ps, Hkv, Dh] with ``layer``) as the reference defines it; needs :func:`available`
    and :func:`supports`."""
    if not available():
        raise RuntimeError("the CPU attention kernel is not available (see its warning)")
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], jnp.zeros((), jnp.int32)
    ps = k_pages.shape[2]
    blocks = blocks_of(batch)
    plan = plan_pages(batch, blocks, page_size=ps, sliding_window=sliding_window, slots=False)
    blk = jnp.stack(
        [blocks.seg, blocks.q_start, blocks.q_len, blocks.kv_pos, plan.lo, plan.hi], axis=1
    ).astype(jnp.int32)
    win = None
    if sliding_window is not None:
        win = row_window_starts(batch, blocks, block_q, sliding_window)
    return attend(q, k_pages, v_pages, layer, plan.pages, plan.order, batch.kv_visible,
                  batch.kv_len, blk, win, sinks, sm_scale)
