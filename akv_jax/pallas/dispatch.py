"""Pick the attention, repos and projection implementations for a backend flag and the running
platform.

``backend``:

* ``"reference"``: the jnp references (any platform);
* ``"pallas"``: the kernel for the platform (GPU: Triton body, TPU: Mosaic body); on the CPU
  the GPU body in interpret mode (slow, for tests: it runs the kernel's own code);
* ``"auto"``: the kernel on GPU and TPU; on the CPU the fused C++ kernel
  (segment_attention_cpu.py, an XLA FFI call), or where it cannot run (no compiler, not
  float32, a tensor-parallel mesh) the chunked jnp attention (chunked.py); both have the
  reference's semantics and read only visible pages; the reference for a shape a kernel
  body cannot take (e.g. a page size that is not a power of two on the GPU).

The returned callables: ``attention(q, k_pages, v_pages, batch, layer=None, sinks=None)``
(:data:`~akv_jax.pallas.metadata.AttentionFn`; ``layer`` given: the pools hold every layer,
[L, P, ps, Hkv, Dh]; ``sinks``: [Hq] sink logits), which
:func:`akv_jax.model.forward.forward` calls, and
``repos(k_pages, pages, old_pos, new_pos, table)``, which the server's re-rotated copies use
(:mod:`akv_jax.serving.device_group`). This is the one factory of each: every path that
attends or re-rotates (model, cache ops, server, benchmarks) gets its function here, and
every forward its projection backend (:func:`make_projection`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from akv_jax.kernels.cpu.per_shard import AXIS, per_shard, tensor_size
from akv_jax.kernels.cpu.projection import CPU
from akv_jax.kernels.projection import XLA, Projection
from akv_jax.pallas import repos as repos_lib
from akv_jax.pallas import segment_attention_cpu as cpu_fused
from akv_jax.pallas.chunked import segment_attention_chunked
from akv_jax.pallas.fixed_tile_projection import fixed_tile_projection
from akv_jax.pallas.metadata import AttentionFn, is_pow2
from akv_jax.pallas.reference import repos_reference, segment_attention_reference
from akv_jax.pallas.segment_attention_gpu import segment_attention_gpu
from akv_jax.pallas.segment_attention_tpu import segment_attention_tpu

BACKENDS = ("auto", "reference", "pallas")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def resolve_backend(backend: str, platform: str | None = None) -> tuple[str, bool]:
    """``(implementation, interpret)``: implementation is "reference", "gpu" or "tpu"."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    platform = platform or jax.default_backend()
    if backend == "reference":
        return "reference", False
    if platform in _GPU_PLATFORMS:
        return "gpu", False
    if platform == "tpu":
        return "tpu", False
    if backend == "auto":
        return "reference", False
    return "gpu", True  # pallas on the CPU: the GPU body, interpreted


def layout_sets_bits(backend: str, deterministic: bool, platform: str | None = None) -> bool:
    """Whether a row's attention bits depend on where its keys lie in their pages, and
    bits are promised: a Pallas body (summing a step of pages at a time, masked slots
    included) interpreted on the CPU or run ``deterministic``. The planner then lays a
    view out as a prefill of its whole history would (``Planner(canonical_layout=True)``)."""
    impl, interpret = resolve_backend(backend, platform)
    return impl != "reference" and (deterministic or interpret)


def local_gpu_cores() -> int | None:
    """SM count of this process's first GPU; None without one (the kernel's default)."""
    try:
        devices = jax.devices()
    except RuntimeError:
        return None
    if not devices or devices[0].platform not in _GPU_PLATFORMS:
        return None
    return getattr(devices[0], "core_count", None)


def make_attention_fn(
    backend: str = "auto",
    *,
    block_q: int,
    sm_scale: float,
    sliding_window: int | None = None,
    platform: str | None = None,
    deterministic: bool = False,
    **kernel_options: Any,
) -> AttentionFn:
    """Segment-batch attention for ``backend`` (see the module docstring):
    ``attention(q, k_pages, v_pages, batch, layer=None, sinks=None)``.

    ``sliding_window`` is static (one function per layer type) and counts visible entries
    (DESIGN §2.1; see :func:`akv_jax.pallas.plan.window_start`); ``sinks`` ([Hq] per-head
    sink logits, GPT-OSS) are a per-layer parameter, so they come with each call.
    ``kernel_options`` go to the kernel body (e.g. ``kv_splits``, ``num_warps`` on the GPU,
    ``vmem_limit_bytes`` on the TPU) and are ignored by the reference.

    ``deterministic``: a row's bits must not depend on the batch (``--deterministic``): the
    GPU body runs without split-K, whose count follows the batch, and with query tiles of one
    size (a decode row's padded to a prefill's). Its interpreted runs on the
    CPU always do (the CPU promises bits in every mode: docs/design.md); the TPU body and the
    CPU's own kernels never split.
    """
    impl, interpret = resolve_backend(backend, platform)
    common = dict(block_q=block_q, sm_scale=sm_scale, sliding_window=sliding_window)
    if impl == "gpu" and (deterministic or interpret):
        kernel_options.update(kv_splits=1, full_tiles=True)
    if impl == "gpu" and not interpret and "num_cores" not in kernel_options:
        # Split-K is sized by the SM count of the GPU it runs on (a deviceless compile
        # names its target's instead: akv_jax.aot).
        kernel_options["num_cores"] = local_gpu_cores()
    reference = functools.partial(segment_attention_reference, **common)
    if impl == "reference":
        if backend == "auto":
            return _cpu_attention(common)
        return reference
    body = segment_attention_gpu if impl == "gpu" else segment_attention_tpu
    kernel = _per_head_shard(
        functools.partial(body, interpret=interpret, **common, **kernel_options)
    )

    def attention(q, k_pages, v_pages, batch, layer=None, sinks=None):
        if layer is not None:  # the kernels take one layer's pool
            k_pages, v_pages = k_pages[layer], v_pages[layer]
        if impl == "gpu" and backend == "auto" and not is_pow2(k_pages.shape[1]):
            return reference(q, k_pages, v_pages, batch, sinks=sinks)
        return kernel(q, k_pages, v_pages, batch, sinks=sinks)

    return attention


def _cpu_attention(common: dict[str, Any]) -> AttentionFn:
    """No Pallas lowering on this platform: the fused C++ kernel (segment_attention_cpu.py)
    where it built and takes the shapes, else the jnp path whose work follows the visible KV
    (chunked.py); both have the reference's semantics, which scores whole views. Under a
    tensor-parallel mesh the kernel runs on each device's heads, as the Pallas kernels do
    (:func:`_per_head_shard`); where the heads do not split evenly, the jnp path, which GSPMD
    partitions (an FFI call it could not)."""
    chunked = functools.partial(segment_attention_chunked, **common)
    fused = functools.partial(cpu_fused.segment_attention_cpu, **common)

    def attention(q, k_pages, v_pages, batch, layer=None, sinks=None):
        if not (cpu_fused.supports(q, k_pages, v_pages) and cpu_fused.available()):
            return chunked(q, k_pages, v_pages, batch, layer=layer, sinks=sinks)
        if tensor_size() == 1:
            return fused(q, k_pages, v_pages, batch, layer=layer, sinks=sinks)
        if not _heads_split(q, k_pages):
            return chunked(q, k_pages, v_pages, batch, layer=layer, sinks=sinks)
        return _on_head_shards(fused, q, k_pages, v_pages, batch, layer, sinks)

    return attention


def _on_head_shards(kernel: Callable[..., jax.Array], q, k_pages, v_pages, batch,
                    layer=None, sinks=None) -> jax.Array:
    """``kernel`` on each device's kv heads and their query heads (q head ``h * G + g``
    reads kv head ``h``, so contiguous shards keep groups whole); pools of one layer, or of
    every layer with ``layer`` (passed on only when given, as ``sinks``)."""
    heads = P(None, AXIS, None)
    kv = P(*([None] * (k_pages.ndim - 2)), AXIS, None)
    extra = {name: (value, spec) for name, value, spec in
             (("layer", layer, P()), ("sinks", sinks, P(AXIS))) if value is not None}

    def body(q, k, v, b, *values):
        return kernel(q, k, v, b, **dict(zip(extra, values, strict=True)))

    specs = (heads, kv, kv, P(), *(spec for _, spec in extra.values()))
    return per_shard(body, specs, heads)(
        q, k_pages, v_pages, batch, *(value for value, _ in extra.values()))


def _heads_split(q: jax.Array, k_pages: jax.Array) -> bool:
    """A tensor-parallel mesh is in context and splits the kv and query heads evenly."""
    tp = tensor_size()
    return tp > 1 and k_pages.shape[-2] % tp == 0 and q.shape[1] % tp == 0


def _per_head_shard(kernel: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """Run ``kernel`` once per tensor-parallel shard of the heads.

    A Pallas kernel is a custom call that GSPMD cannot partition: XLA:TPU refuses it
    ("Mosaic kernels cannot be automatically partitioned"), XLA:GPU would gather every
    operand onto each device. Attention is independent per kv head, so under a mesh with a
    "tensor" axis (set by the serving step, see
    :func:`akv_jax.serving.device_group.forward_step`) each device runs the kernel on its
    own heads (:func:`_on_head_shards`). Without such a mesh, or when the kv heads do not
    split evenly (then the pool is replicated: :func:`akv_jax.model.params.logical_to_spec`),
    the kernel is called as is.
    """

    def call(q, k_pages, v_pages, batch, sinks=None):
        if not _heads_split(q, k_pages):
            return kernel(q, k_pages, v_pages, batch, sinks=sinks)
        return _on_head_shards(kernel, q, k_pages, v_pages, batch, sinks=sinks)

    return call


def make_repos_fn(
    backend: str = "auto", *, platform: str | None = None
) -> Callable[..., jax.Array]:
    """``repos(k_pages, pages, old_pos, new_pos, table) -> k_pages`` for ``backend``."""
    impl, interpret = resolve_backend(backend, platform)
    if impl == "reference":
        return repos_reference

    def kernel(k_pages, pages, old_pos, new_pos, table):
        return repos_lib.repos_pallas(
            k_pages, pages, old_pos, new_pos, table, body=impl, interpret=interpret
        )

    def repos(k_pages, pages, old_pos, new_pos, table):
        _, ps, heads, dh = k_pages.shape
        r = table.rotary_dim
        if impl == "gpu" and backend == "auto" and not repos_lib.gpu_supports(ps, dh, r):
            return repos_reference(k_pages, pages, old_pos, new_pos, table)
        # Per tensor-parallel head shard, as attention (see _per_head_shard): every head
        # rotates alike, so each device rotates its own heads' keys.
        tp = tensor_size()
        if tp == 1 or heads % tp:
            return kernel(k_pages, pages, old_pos, new_pos, table)
        kv = P(None, None, AXIS, None)
        return per_shard(kernel, (kv, P(), P(), P(), P()), kv)(
            k_pages, pages, old_pos, new_pos, table)

    return repos


def make_projection(platform: str | None = None, deterministic: bool = False) -> Projection:
    """The projection backend for ``platform`` (default: the running one): on the CPU the C++
    kernels' (:mod:`akv_jax.kernels.cpu.projection`: XLA's products for shapes its kernels do
    not take, under a tensor-parallel mesh, and in a lowering for another platform), whose
    rows keep their bits in any batch; elsewhere XLA's products, or with ``deterministic``
    the fixed-tile Pallas matmul's (:mod:`akv_jax.pallas.fixed_tile_projection`)."""
    platform = platform or jax.default_backend()
    if platform == "cpu":
        return CPU
    return fixed_tile_projection(platform) if deterministic else XLA
