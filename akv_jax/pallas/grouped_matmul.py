"""Grouped matmul for mixture-of-experts layers: rows sorted by group, one weight per group.

``grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]``, row ``i`` of group
``g`` multiplied by ``rhs[g]``; the semantics of ``jax.lax.ragged_dot`` (its reference).

Why not always ``ragged_dot``: XLA:CPU lowers it to one dense product of ``lhs`` spread over
every group (``[M, G*K] @ [G*K, N]`` with the other groups' columns masked to zero), G times
the work: for GPT-OSS's 32 experts and top-4 that is 8x the FLOPs of a dense all-experts
einsum of the same tokens, and slower than it (``bench/moe.py``). On the CPU this module runs
the grouped matmul as a scan over (row tile, group) pairs, the schedule of megablox's
``gmm``: the sorted rows are cut into tiles of ``tile`` rows; a tile meets the groups whose
rows it holds, so there are at most ``num_tiles + G - 1`` pairs, each one ``[tile, K] @
[K, N]`` product masked to the tile's rows of that group. Work is ``(M + G*tile) K N``
instead of ``G M K N``. On GPU and TPU, XLA's own ``ragged_dot`` is a grouped GEMM and is
used as is.

``rhs`` may also be an :class:`Mxfp4Weight` (``--moe-weight-format mxfp4``: expert weights kept
packed on the device as GPT-OSS releases them, ~0.27x of bfloat16's memory). The tiled path
then dequantises one expert's ``[K, N]`` per (row tile, expert) pair inside the scan, so only
one expert is ever dense; ``ragged_dot`` dequantises the whole ``[G, K, N]`` for the call (a
transient of one layer's experts). Dequantised values are exact in float32 and bfloat16, so
packed and dense weights give the same products.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_TILE = 32
MXFP4_BLOCK = 32
# e2m1 code -> value (the OCP MX table; converters/mxfp4.py holds the same one).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)  # codes 8-15: the sign bit set


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Weight:
    """A weight of dense shape ``[..., in, out]`` kept in MXFP4, GPT-OSS's released layout:
    ``blocks`` uint8 ``[..., out, in/32, 16]`` (two e2m1 codes a byte, low nibble first) and
    ``scales`` uint8 ``[..., out, in/32]`` (powers of two biased by 127)."""

    blocks: Any
    scales: Any

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out, groups, _ = self.blocks.shape
        return (*lead, groups * MXFP4_BLOCK, out)

    @staticmethod
    def packed_shapes(dense_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(blocks shape, scales shape) of a weight of dense shape ``[..., in, out]``."""
        *lead, n_in, out = dense_shape
        if n_in % MXFP4_BLOCK:
            raise ValueError(f"mxfp4 needs the input dimension to be a multiple of "
                             f"{MXFP4_BLOCK}, got {n_in}")
        groups = n_in // MXFP4_BLOCK
        return (*lead, out, groups, MXFP4_BLOCK // 2), (*lead, out, groups)


def dequantize_mxfp4(blocks: jax.Array, scales: jax.Array, dtype: Any) -> jax.Array:
    """``[..., out, in/32, 16]`` codes and ``[..., out, in/32]`` scales -> ``[..., in, out]``."""
    codes = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble first
    codes = codes.reshape(*blocks.shape[:-1], MXFP4_BLOCK).astype(jnp.int32)
    table = jnp.asarray(np.asarray(FP4_VALUES, np.float32))
    scale = jnp.ldexp(jnp.float32(1), scales.astype(jnp.int32) - 127)
    vals = table[codes] * scale[..., None]  # exact: a float32 times a power of two
    vals = vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)  # [..., out, in]
    return jnp.swapaxes(vals, -1, -2).astype(dtype)


def _ragged_dot(lhs: jax.Array, rhs: jax.Array | Mxfp4Weight, group_sizes: jax.Array) -> jax.Array:
    if isinstance(rhs, Mxfp4Weight):
        rhs = dequantize_mxfp4(rhs.blocks, rhs.scales, lhs.dtype)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def grouped_matmul(
    lhs: jax.Array, rhs: jax.Array | Mxfp4Weight, group_sizes: jax.Array, *,
    impl: str = "auto", tile: int = DEFAULT_TILE,
) -> jax.Array:
    """``impl``: "ragged_dot" (XLA), "tiled" (the scan above) or "auto" (tiled on the CPU).

    "auto" is decided when the program is lowered, for the platform it is lowered for
    (``lax.platform_dependent``), not by this process's default backend: a deviceless
    compile for a GPU or TPU (akv_jax.aot) gets ragged_dot, as a run there does.
    """
    if impl == "auto":
        return jax.lax.platform_dependent(
            lhs, rhs, group_sizes,
            cpu=functools.partial(grouped_matmul_tiled, tile=tile), default=_ragged_dot,
        )
    if impl == "ragged_dot":
        return _ragged_dot(lhs, rhs, group_sizes)
    if impl != "tiled":
        raise ValueError(f"unknown grouped matmul impl {impl!r}")
    return grouped_matmul_tiled(lhs, rhs, group_sizes, tile=tile)


def grouped_matmul_tiled(
    lhs: jax.Array, rhs: jax.Array | Mxfp4Weight, group_sizes: jax.Array, *,
    tile: int = DEFAULT_TILE,
) -> jax.Array:
    M, K = lhs.shape
    G, _, N = rhs.shape
    if isinstance(rhs, Mxfp4Weight):
        out_dtype = lhs.dtype

        def weight(g):
            # The barrier keeps the dequantisation out of the product: fused into it, XLA:CPU
            # (on AVX2 hosts) emits its own loop for the dot, which sums in another order than
            # the GEMM a dense weight gets, and packed and dense weights would differ.
            return jax.lax.optimization_barrier(
                dequantize_mxfp4(rhs.blocks[g], rhs.scales[g], lhs.dtype))
    else:
        out_dtype = jnp.result_type(lhs.dtype, rhs.dtype)

        def weight(g):
            return rhs[g]

    num_tiles = -(-M // tile)
    x = jnp.pad(lhs, ((0, num_tiles * tile - M), (0, 0)))
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    # Groups of each tile's first and last row (rows past M belong to the last group).
    first_row = jnp.arange(num_tiles, dtype=jnp.int32) * tile
    last_row = jnp.minimum(first_row + tile, M) - 1
    g_first = jnp.minimum(jnp.searchsorted(ends, first_row, side="right"), G - 1)
    g_last = jnp.minimum(jnp.searchsorted(ends, last_row, side="right"), G - 1)
    per_tile = g_last - g_first + 1
    pair_start = jnp.cumsum(per_tile) - per_tile
    num_pairs = num_tiles + G - 1  # static bound: consecutive tiles share a boundary group
    p = jnp.arange(num_pairs, dtype=jnp.int32)
    pair_tile = jnp.minimum(jnp.searchsorted(pair_start, p, side="right") - 1, num_tiles - 1)
    pair_group = g_first[pair_tile] + p - pair_start[pair_tile]
    real = p < pair_start[-1] + per_tile[-1]
    pair_group = jnp.where(real, jnp.minimum(pair_group, G - 1), 0)

    def one(out, pair):
        t, g, ok = pair
        rows = t * tile + jnp.arange(tile, dtype=jnp.int32)
        mine = ok & (rows >= starts[g]) & (rows < ends[g])
        xt = jax.lax.dynamic_slice_in_dim(x, t * tile, tile, axis=0)
        yt = jnp.dot(xt, weight(g), preferred_element_type=jnp.float32)
        acc = jax.lax.dynamic_slice_in_dim(out, t * tile, tile, axis=0)
        acc = acc + jnp.where(mine[:, None], yt, 0.0)
        return jax.lax.dynamic_update_slice_in_dim(out, acc, t * tile, axis=0), None

    out = jnp.zeros((num_tiles * tile, N), jnp.float32)
    out, _ = jax.lax.scan(one, out, (pair_tile, pair_group, real))
    return out[:M].astype(out_dtype)
