"""A fixed-tile matmul in Pallas: the product a ``--deterministic`` server is to run on GPU and
TPU (issue 38), beside its reference :func:`matmul_reference`.

XLA picks a product's algorithm and tiling by its shape (cuBLAS or Triton tilings and split-K
on a GPU), so a row's sums change with the number of rows beside it: a request's bits move
with the batch. Here every output tile is ``bm x bn`` and sums ``k`` in slices of ``bk``, in
order, one tile product per slice, whatever the number of rows: a row's result depends on its
own data, as long as the tile product treats each of its rows alike (a GPU's MMA and a TPU's
MXU compute every row of a tile the same way; interpreted on the CPU, XLA's dot of the fixed
tile shape does too: ``tests/test_pallas_matmul.py``).

One body serves both lowerings: x's row block ``[bm, K]`` and w's column block ``[K, bn]``
(``K`` padded to a multiple of ``bk``), sliced along ``k`` inside the kernel. Rows, columns
and ``k`` past the operands' shapes are zero padding, added on the way in and sliced off.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Output tile ``bm x bn`` and ``k`` slice ``bk``: powers of two (Triton), ``bn`` and ``bk``
    multiples of 128 and ``bm`` of 8 (a TPU's lanes and sublanes)."""

    bm: int = 64
    bn: int = 128
    bk: int = 128


DEFAULT_TILES = Tiles()
# float32 on a GPU: a full-precision dot takes three bfloat16 passes, and 64 x 128 x 128 tiles
# spill registers (ptxas' report in a deviceless sm_90 compile, akv_jax.aot).
GPU_FLOAT32_TILES = Tiles(bm=32, bn=64, bk=32)


def is_gpu(platform: str) -> bool:
    return platform in ("cuda", "gpu")


def default_tiles(dtype, platform: str) -> Tiles:
    """The tiles of ``dtype`` operands on ``platform`` ("cuda", "tpu" or "cpu")."""
    if is_gpu(platform) and jnp.dtype(dtype) == jnp.float32:
        return GPU_FLOAT32_TILES
    return DEFAULT_TILES


def matmul_reference(x: jax.Array, w: jax.Array, transpose_w: bool = False) -> jax.Array:
    """``x @ w`` (``x @ w.T``) in float32 at full precision: what the kernel is checked
    against."""
    w = w.T if transpose_w else w
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)


def _kernel(x_ref, w_ref, o_ref, *, bk: int, transpose_w: bool):
    # x_ref [bm, Kp], w_ref [Kp, bn] ([bn, Kp] when transpose_w), o_ref [bm, bn]
    # float32 in full precision: a GPU's default float32 dot is TF32 (10 mantissa bits).
    prec = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    w_k = 1 if transpose_w else 0  # w's contracted axis

    def body(i, acc):
        k0 = pl.multiple_of(i * bk, bk)
        x = x_ref[:, pl.ds(k0, bk)]
        w = w_ref[:, pl.ds(k0, bk)] if transpose_w else w_ref[pl.ds(k0, bk), :]
        return acc + jax.lax.dot_general(x, w, (((1,), (w_k,)), ((), ())), precision=prec,
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // bk, body,
                            jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _pad_to(a: jax.Array, rows: int, cols: int) -> jax.Array:
    r, c = a.shape
    if (r, c) == (rows, cols):
        return a
    return jnp.pad(a, ((0, rows - r), (0, cols - c)))


@functools.partial(jax.jit, static_argnames=("tiles", "out_dtype", "transpose_w", "platform",
                                             "interpret"))
def fixed_tile_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    tiles: Tiles | None = None,
    out_dtype=None,
    transpose_w: bool = False,
    platform: str | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x [M, K] @ w [K, N]`` -> ``[M, N]`` (``out_dtype``, default x's), float32
    accumulation, each row's sums in an order fixed by ``tiles`` alone (default:
    :func:`default_tiles`). ``transpose_w``: ``w`` is [N, K] and the product ``x @ w.T``,
    read in place (a tied embedding: no transposed copy per step). ``platform`` ("cuda" or
    "tpu"; default the running backend) picks the compiler parameters; ``interpret`` runs the
    body on any platform (tests)."""
    (M, K), (N, K2) = x.shape, (w.shape[::-1] if not transpose_w else w.shape)
    if K != K2:
        shape = f"[{N}, {K2}].T" if transpose_w else f"[{K2}, {N}]"
        raise ValueError(f"fixed_tile_matmul: x [M, {K}] @ w {shape}")
    platform = platform or jax.default_backend()
    tiles = tiles or default_tiles(x.dtype, platform)
    bm, bn, bk = tiles.bm, tiles.bn, tiles.bk
    Mp, Np, Kp = -(-M // bm) * bm, -(-N // bn) * bn, -(-K // bk) * bk
    out_dtype = out_dtype or x.dtype
    params = None
    if not interpret:
        params = (plgpu.CompilerParams(num_warps=4, num_stages=2) if is_gpu(platform)
                  else pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")))
    if transpose_w:
        w_spec, w_padded = pl.BlockSpec((bn, Kp), lambda i, j: (j, 0)), _pad_to(w, Np, Kp)
    else:
        w_spec, w_padded = pl.BlockSpec((Kp, bn), lambda i, j: (0, j)), _pad_to(w, Kp, Np)
    y = pl.pallas_call(
        functools.partial(_kernel, bk=bk, transpose_w=transpose_w),
        grid=(Mp // bm, Np // bn),
        in_specs=[pl.BlockSpec((bm, Kp), lambda i, j: (i, 0)), w_spec],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), out_dtype),
        compiler_params=params,
        interpret=interpret,
        name="akv_fixed_tile_matmul",
    )(_pad_to(x, Mp, Kp), w_padded)
    return y[:M, :N]
