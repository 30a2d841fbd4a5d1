"""Segment-batch attention as one fused XLA:CPU kernel (``attention.cc``, an XLA FFI call):
the binding. :mod:`akv_jax.pallas.segment_attention_cpu` builds the page plan it reads from
a segment batch, as the GPU and TPU entries do for theirs.

The CPU has no Pallas lowering, and the jnp path (``pallas/chunked.py``) pays for every
element-wise pass of its online softmax over memory: in a long prefill those passes cost
more than the attention's two matmuls. This kernel keeps a query block's scores,
exponentials and probabilities in registers, reads each block's compacted visible pages
straight from the paged pool, and runs its items (query block x kv head) on XLA's own
intra-op threads. Same semantics as the reference (``tests/test_cpu_attention.py``); float32
only.

Built on first use (:mod:`akv_jax.kernels.cpu.ffi`); where it cannot be (no compiler,
``AKV_JAX_CPU_KERNEL=0``) :func:`available` is False and ``--attention-backend auto`` keeps
the jnp path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.kernels.cpu import ffi

TARGET = "akv_cpu_attention"


def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (builds it on first call)."""
    return ffi.register("attention.cc", TARGET, "AkvCpuAttention")


def supports(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> bool:
    """Shapes and dtypes the kernel takes: float32 throughout, head_dim 16..256 in 16s."""
    dh = q.shape[-1]
    return (
        q.dtype == k_pages.dtype == v_pages.dtype == jnp.float32
        and dh % 16 == 0
        and 16 <= dh <= 256
        and k_pages.shape[-1] == dh
    )


def attend(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    layer: jax.Array,
    pages: jax.Array,
    order: jax.Array,
    kv_visible: jax.Array,
    kv_len: jax.Array,
    blocks: jax.Array,
    window_starts: jax.Array | None,
    sinks: jax.Array | None,
    sm_scale: float,
) -> jax.Array:
    """The kernel's call: ``q`` [T, Hq, Dh] against layer ``layer`` of the pools
    [L, P, ps, Hkv, Dh]. ``pages``, ``order``: the page plan; ``kv_visible``, ``kv_len``:
    the batch's; ``blocks`` [NB, 6] int32 (seg, q_start, q_len, kv_pos, and the plan's lo
    and hi); ``window_starts``: each row's first visible entry (a sliding window) or None;
    ``sinks`` [Hq] or None. Needs :func:`available` and :func:`supports`."""
    if not available():
        raise RuntimeError("the CPU attention kernel is not available (see its warning)")
    win = (jnp.zeros((1, 1), jnp.int32) if window_starts is None
           else window_starts.astype(jnp.int32))
    sink_arg = (jnp.zeros((1,), jnp.float32) if sinks is None
                else sinks.astype(jnp.float32).reshape(-1))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q, k_pages, v_pages, jnp.asarray(layer, jnp.int32).reshape(1), pages, order,
        kv_visible, kv_len, blocks, win, sink_arg,
        sm_scale=np.float32(sm_scale),
        has_window=np.int64(window_starts is not None),
        has_sinks=np.int64(sinks is not None),
    )
