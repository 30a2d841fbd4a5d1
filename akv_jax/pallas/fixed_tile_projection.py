"""The deterministic projection backend: every product by weights through the fixed-tile
Pallas matmul (:func:`akv_jax.pallas.matmul.fixed_tile_matmul`), so a row's sums do not depend
on the rows beside it. ``--deterministic`` runs it on GPU and TPU, where XLA picks a product's
tiling (and split-K) by its shape (:func:`akv_jax.pallas.dispatch.make_projection`); on the
CPU the default backend's kernels already have that property, and this one runs interpreted
only in tests.

Its layout is the loaded weights (plain arrays, every layer stacked: the layer scan slices
them). A product ``einsum(eq, x, w)`` contracts every non-token axis of ``x`` against ``w``'s
leading axes, so it is one ``[T, K] @ [K, N]`` product of reshaped operands.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from akv_jax.kernels.projection import Projection, zero_past
from akv_jax.pallas.matmul import fixed_tile_matmul


def _operand_axes(eq: str, x: jax.Array, w: jax.Array) -> int:
    """The number of ``w``'s contracted (leading) axes; raises unless ``eq`` contracts every
    non-token axis of ``x`` against them, in order, and keeps the rest in order."""
    ins, out = eq.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    k = len(xs) - 1
    if not (ws[:k] == xs[1:] and out == xs[0] + ws[k:] and x.ndim == len(xs)
            and w.ndim == len(ws)):
        raise ValueError(f"fixed-tile projection: {eq!r} is not a product by weights "
                         f"(x {x.shape}, w {w.shape})")
    return k


@functools.cache
def fixed_tile_projection(platform: str | None = None, interpret: bool = False) -> Projection:
    """The backend for ``platform`` ("cuda" or "tpu"; default the running one); one object
    per arguments (a :class:`Projection` is a static jit argument, hashed by identity).
    ``interpret``: the kernels interpreted (any platform: tests)."""
    matmul = functools.partial(fixed_tile_matmul, platform=platform, interpret=interpret)

    def product(eq: str, x: jax.Array, w: jax.Array, live: jax.Array | None = None
                ) -> jax.Array:
        k = _operand_axes(eq, x, w)
        dtype = jnp.result_type(x, w)
        T, out_shape = x.shape[0], w.shape[k:]
        w2 = w.reshape(math.prod(w.shape[:k]), math.prod(out_shape))
        y = matmul(x.reshape(T, -1).astype(dtype), w2.astype(dtype))
        return zero_past(y.reshape(T, *out_shape), live)

    def residual_product(eq, x, w, residual, live=None):
        return residual + product(eq, x, w, live)

    def gated_product(x, w, gate, live=None):
        return jax.nn.silu(gate) * product("td,df->tf", x, w, live)

    def head_product(x: jax.Array, w: jax.Array, tied: bool) -> jax.Array:
        dtype = jnp.result_type(x, w)
        return matmul(x.astype(dtype), w.astype(dtype), out_dtype=jnp.float32,
                      transpose_w=tied)

    name = "fixed_tile" + ("_interpret" if interpret else "")
    return Projection(name, product, residual_product, gated_product, head_product)
