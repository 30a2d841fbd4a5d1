"""Segment-batch attention as one fused XLA:CPU kernel (``cpu_attention.cc``, an XLA FFI call).

The CPU has no Pallas lowering, and the jnp path (chunked.py) pays for every element-wise
pass of its online softmax over memory: in a 2,000-token SmolLM2 prefill those passes cost
more than the attention's two matmuls. This kernel keeps a query block's scores,
exponentials and probabilities in registers, reads each block's compacted visible pages
(:func:`akv_jax.pallas.plan.plan_pages`) straight from the paged pool, and runs its items
(query block x kv head) on XLA's own intra-op threads. Same semantics as the reference
(tests compare them, ``tests/test_cpu_attention.py``); float32 only.

Built on first use (:mod:`akv_jax.pallas.cpu_ffi`); where it cannot be (no compiler,
``AKV_JAX_CPU_KERNEL=0``) :func:`available` is False and ``--attention-backend auto`` keeps
the jnp path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.pallas import cpu_ffi
from akv_jax.pallas.metadata import SegmentBatch
from akv_jax.pallas.plan import blocks_of, plan_pages, row_window_starts

TARGET = "akv_cpu_attention"


def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (builds it on first call)."""
    return cpu_ffi.register("cpu_attention.cc", TARGET, "AkvCpuAttention")


def supports(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> bool:
    """Shapes and dtypes the kernel takes: float32 throughout, head_dim 16..256 in 16s."""
    dh = q.shape[-1]
    return (
        q.dtype == k_pages.dtype == v_pages.dtype == jnp.float32
        and dh % 16 == 0
        and 16 <= dh <= 256
        and k_pages.shape[-1] == dh
    )


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
    if sliding_window is not None:
        win = row_window_starts(batch, blocks, block_q, sliding_window).astype(jnp.int32)
    else:
        win = jnp.zeros((1, 1), jnp.int32)
    sink_arg = (jnp.zeros((1,), jnp.float32) if sinks is None
                else sinks.astype(jnp.float32).reshape(-1))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q, k_pages, v_pages, jnp.asarray(layer, jnp.int32).reshape(1), plan.pages,
        plan.order, batch.kv_visible, batch.kv_len, blk, win, sink_arg,
        sm_scale=np.float32(sm_scale),
        has_window=np.int64(sliding_window is not None),
        has_sinks=np.int64(sinks is not None),
    )
