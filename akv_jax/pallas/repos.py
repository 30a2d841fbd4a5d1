"""Repos kernel: re-rotate the stored keys of listed pages, in place (``K' = R(new) R(old)^-1 K``).

The combined rotation per slot is computed outside the kernel by
:func:`akv_jax.pallas.rotary.rotation_tables`, the same function
:func:`~akv_jax.pallas.rotary.rerotate` uses (the table's float32 cos/sin at the old and the
new position, combined by the difference formulas in float32), so the kernel matches
:func:`akv_jax.pallas.reference.repos_reference` to rounding at any position; a float32
``delta * inv_freq`` angle would be off by ~1e-3 rad at 32k. Only ``[N, page_size, Dh]`` of
angles travel, against ``[N, page_size, Hkv, Dh]`` keys read and written.

Partial rotary (DESIGN §2.1): a table of ``r/2 < Dh/2`` columns rotates the first ``r`` dims of
each key and leaves the others' bits untouched (the GPU body never stores them; the TPU body
multiplies them by cos 1 and sin 0, exact).

The key pool is aliased input -> output and only listed pages are written, so every other
page keeps its bits. For a real in-place update call it under ``jax.jit(...,
donate_argnums=...)`` (or inside the step that owns the pool). Listed pages must be distinct;
entries ``>= P`` are padding and touch nothing.

Two bodies:

* GPU (Triton lowering): grid ``(page, kv head)``, the two halves of the half-split layout
  loaded and stored separately, so page size and head_dim/2 must be powers of two
  (:func:`gpu_supports`);
* TPU (Mosaic): grid over pages, scalar-prefetched page ids, manual DMA of the page to VMEM
  and back under ``pl.when`` so padding entries write nothing.

The server calls it (through :func:`akv_jax.pallas.dispatch.make_repos_fn`) for its
re-rotated copies, on temporary pages (see :mod:`akv_jax.serving.device_group`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from akv_jax.pallas.metadata import is_pow2
from akv_jax.pallas.rotary import RopeTable, rotate_halves, rotation_tables

# ----------------------------------------------------------------------------------------- GPU


def gpu_supports(page_size: int, head_dim: int, rotary_dim: int | None = None) -> bool:
    """Triton tensors are power-of-two sized: page size and half the rotary dims (the head
    dim unless partial rotary) must be."""
    r = head_dim if rotary_dim is None else rotary_dim
    return is_pow2(page_size) and r % 2 == 0 and is_pow2(r // 2)


def _repos_gpu_kernel(pages_ref, cos_ref, sin_ref, k_ref, o_ref, *, interpret: bool):
    # pages_ref [N]; cos_ref, sin_ref [ps, r/2] (this page); k_ref, o_ref [P, ps, Hkv, Dh]
    # (one buffer: aliased; read the input, write the output).
    half = cos_ref.shape[-1]
    page = pages_ref[pl.program_id(0)]
    h = pl.program_id(1)

    @pl.when(page < k_ref.shape[0])
    def _():
        x1 = k_ref[page, :, h, pl.ds(0, half)].astype(jnp.float32)
        x2 = k_ref[page, :, h, pl.ds(half, half)].astype(jnp.float32)
        # Interpreted (XLA), each product rounded as the forward's rotation rounds it.
        lo, hi = rotate_halves(x1, x2, cos_ref[...], sin_ref[...], round_products=interpret)
        o_ref[page, :, h, pl.ds(0, half)] = lo.astype(o_ref.dtype)
        o_ref[page, :, h, pl.ds(half, half)] = hi.astype(o_ref.dtype)


def _repos_gpu(k_pages, pages, cos, sin, *, interpret: bool):
    P, ps, Hkv, Dh = k_pages.shape
    half = cos.shape[-1]
    if not gpu_supports(ps, Dh, 2 * half):
        raise ValueError(
            f"the GPU repos kernel needs power-of-two page size and rotary_dim/2: {ps}, {half}"
        )
    N = pages.shape[0]
    whole = pl.BlockSpec(k_pages.shape, lambda n, h: (0, 0, 0, 0))
    tab = pl.BlockSpec((None, ps, half), lambda n, h: (n, 0, 0))
    return pl.pallas_call(
        functools.partial(_repos_gpu_kernel, interpret=interpret),
        grid=(N, Hkv),
        in_specs=[pl.BlockSpec((N,), lambda n, h: (0,)), tab, tab, whole],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="akv_repos",
    )(pages, cos, sin, k_pages)


# ----------------------------------------------------------------------------------------- TPU


def _repos_tpu_kernel(pages_ref, cos_ref, sin_ref, k_hbm, o_hbm, buf, sem, *, half):
    # pages_ref [N] (SMEM); cos_ref/sin_ref [ps, Dh] full-width (cos|cos, -sin|sin; partial
    # rotary: [cos|cos|1, -sin|0|0] and a second sin table [0|sin|0]);
    # k_hbm/o_hbm the aliased pool in HBM; buf [ps, Hkv, Dh] VMEM.
    del k_hbm  # same buffer as o_hbm; reading through the output keeps one name for it
    page = pages_ref[pl.program_id(0)]

    @pl.when(page < o_hbm.shape[0])
    def _():
        copy_in = pltpu.make_async_copy(o_hbm.at[page], buf, sem)
        copy_in.start()
        copy_in.wait()
        c, s = cos_ref[...], sin_ref[...]  # [ps, Dh]
        dh = buf.shape[-1]
        for h in range(buf.shape[1]):  # static; 2-D [ps, Dh] tiles, the same as attention's
            x = buf[:, h, :].astype(jnp.float32)
            if 2 * half == dh:
                # rotate_half without lane slicing: rolling by Dh/2 swaps the halves.
                swapped = pltpu.roll(x, half, 1)
                buf[:, h, :] = (x * c + swapped * s).astype(buf.dtype)
            else:
                # Partial rotary: lane i < half takes -x[i + half] * sin (roll by Dh - half),
                # lane half <= i < 2 half takes x[i - half] * sin (roll by half).
                s_lo, s_hi = s[:, :dh], s[:, dh:]
                ahead = pltpu.roll(x, dh - half, 1)
                behind = pltpu.roll(x, half, 1)
                buf[:, h, :] = (x * c + ahead * s_lo + behind * s_hi).astype(buf.dtype)
        copy_out = pltpu.make_async_copy(buf, o_hbm.at[page], sem)
        copy_out.start()
        copy_out.wait()


def _repos_tpu(k_pages, pages, cos, sin, *, interpret):
    P, ps, Hkv, Dh = k_pages.shape
    half = cos.shape[-1]
    if 2 * half == Dh:
        cos_full = jnp.concatenate([cos, cos], axis=-1)
        sin_full = jnp.concatenate([-sin, sin], axis=-1)  # x*cos + swap(x)*sin == rerotate
    else:  # partial rotary: the pass-through lanes get cos 1, sin 0 (exact)
        ones = jnp.ones((*cos.shape[:-1], Dh - 2 * half), cos.dtype)
        zeros, zh = jnp.zeros_like(ones), jnp.zeros_like(sin)
        cos_full = jnp.concatenate([cos, cos, ones], axis=-1)
        sin_full = jnp.concatenate(
            [-sin, zh, zeros, zh, sin, zeros], axis=-1
        )  # [ps, 2 Dh]: the lo table, then the hi table
    w = sin_full.shape[-1]
    tab = pl.BlockSpec((None, ps, Dh), lambda n, pages_ref: (n, 0, 0))
    stab = pl.BlockSpec((None, ps, w), lambda n, pages_ref: (n, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_repos_tpu_kernel, half=half),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(pages.shape[0],),
            in_specs=[tab, stab, any_spec],
            out_specs=any_spec,
            scratch_shapes=[pltpu.VMEM((ps, Hkv, Dh), k_pages.dtype), pltpu.SemaphoreType.DMA],
        ),
        out_shape=jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
        # Operand 3 counts the scalar-prefetch operand: (pages, cos, sin, k_pages).
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="akv_repos",
    )(pages, cos_full, sin_full, k_pages)


@functools.partial(jax.jit, static_argnames=("body", "interpret"))
def repos_pallas(
    k_pages: jax.Array,
    pages: jax.Array,
    old_pos: jax.Array,
    new_pos: jax.Array,
    table: RopeTable,
    *,
    body: str = "gpu",
    interpret: bool = False,
) -> jax.Array:
    """Kernel version of ``repos_reference`` (same arguments, same result).

    ``body``: "gpu" (Triton) or "tpu" (Mosaic); under ``interpret`` either runs on the CPU.
    """
    if k_pages.shape[-1] % 2:
        raise ValueError(f"head_dim must be even, got {k_pages.shape[-1]}")
    pages = pages.astype(jnp.int32)
    cos, sin = rotation_tables(old_pos, new_pos, table)
    if body == "gpu":
        return _repos_gpu(k_pages, pages, cos, sin, interpret=interpret)
    if body == "tpu":
        return _repos_tpu(k_pages, pages, cos, sin, interpret=interpret)
    raise ValueError(f"unknown repos body {body!r}")
