"""What the model's forward calls for its matrix products by weights: a :class:`Projection`
backend, chosen once for a device group (``akv_jax.pallas.dispatch.make_projection``) and
passed into the forward as the attention function is.

A backend multiplies by the weights in the layout it holds them in. :data:`XLA` takes plain
arrays and runs XLA's own products everywhere; the CPU backend
(:mod:`akv_jax.kernels.cpu.projection`) runs the C++ kernels where they apply and also takes
its packed layout. Every backend takes an :class:`Adapted` weight (LoRA, applied unmerged)
the same way, and agrees on the padding rows: rows from ``live`` on come back zero.

A backend's layout may hold a weight for every layer at once and read it in place (a
:class:`LayerIndexed`): the forward's layer scan then does not slice it, and hands each layer
``weight.at(layer)`` instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Adapted:
    """A projection weight with a low-rank update applied *unmerged* (LoRA, built by
    :mod:`akv_jax.train.lora`): ``x @ base + scale * (x @ a) @ b``, never forming
    ``base + scale * a @ b``. ``a`` [..., in..., r] and ``b`` [..., r, out...] carry the same
    leading (layer) axes as ``base``, so the layer scan slices all three alike."""

    base: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float


jax.tree_util.register_dataclass(Adapted, data_fields=["base", "a", "b"], meta_fields=["scale"])


class LayerIndexed:
    """A weight of every layer that the forward's layer scan reads in place: the scan does not
    slice it, and gives layer ``layer`` (an int32 scalar) :meth:`at`'s result, which the
    backend that made it takes in its products."""

    def at(self, layer: jax.Array) -> Any:
        raise NotImplementedError


def zero_past(y: jax.Array, live: jax.Array | None) -> jax.Array:
    """``y`` [T, ...] with its rows from ``live`` on zeroed (``live`` None: ``y``): a step's
    padding rows, which every path of every backend returns as zeros."""
    if live is None:
        return y
    rows = jnp.arange(y.shape[0]).reshape(-1, *([1] * (y.ndim - 1)))
    return jnp.where(rows < jnp.reshape(live, (-1,))[0], y, 0).astype(y.dtype)


def adapted_product(eq: str, x: jax.Array, w: Adapted, live: jax.Array | None) -> jax.Array:
    """``einsum(eq, x, base) + scale * (x @ a) @ b``, rows from ``live`` on zero: XLA's
    products on every backend (training differentiates it)."""
    low = jnp.tensordot(x, w.a, axes=x.ndim - 1)  # [T, r]
    y = jnp.einsum(eq, x, w.base) + w.scale * jnp.tensordot(low, w.b, axes=1)
    return zero_past(y, live)


Product = Callable[[str, jax.Array, Any, jax.Array | None], jax.Array]
ResidualProduct = Callable[[str, jax.Array, Any, jax.Array, jax.Array | None], jax.Array]
GatedProduct = Callable[[jax.Array, Any, jax.Array, jax.Array | None], jax.Array]
HeadProduct = Callable[[jax.Array, jax.Array, bool], jax.Array]


@dataclasses.dataclass(frozen=True, eq=False)
class Projection:
    """A projection backend: four products, each taking the weights in the backend's layout.
    Hashed by identity (a static jit argument: each backend is one module-level object).

    * ``product(eq, x, w, live)``: ``einsum(eq, x, w)`` for ``x`` [T, in...] and ``w``
      [in..., out...] (every non-token axis of ``x`` contracted);
    * ``residual_product(eq, x, w, residual, live)``: ``residual + product(...)``;
    * ``gated_product(x, w, gate, live)``: SwiGLU's ``silu(gate) * (x @ w)``, ``x`` [T, D],
      ``w`` [D, F], ``gate`` [T, F];
    * ``head_product(x, w, tied)``: float32 logits ``x @ w`` (``tied``: ``x @ w.T`` for the
      embedding [V, D]).

    Rows from ``live`` on come back zero (``residual`` there for the residual product). The
    forward calls the methods, which take :class:`Adapted` weights alike on every backend.
    """

    name: str
    product: Product
    residual_product: ResidualProduct
    gated_product: GatedProduct
    head_product: HeadProduct

    def __call__(self, eq: str, x: jax.Array, w: Any, live: jax.Array | None = None
                 ) -> jax.Array:
        if isinstance(w, Adapted):
            return adapted_product(eq, x, w, live)
        return self.product(eq, x, w, live)

    def add(self, eq: str, x: jax.Array, w: Any, residual: jax.Array,
            live: jax.Array | None = None) -> jax.Array:
        """``residual + self(eq, x, w, live)``."""
        if isinstance(w, Adapted):
            return residual + adapted_product(eq, x, w, live)
        return self.residual_product(eq, x, w, residual, live)

    def gated(self, x: jax.Array, w: Any, gate: jax.Array, live: jax.Array | None = None
              ) -> jax.Array:
        """``silu(gate) * (x @ w)`` (SwiGLU's up projection and activation)."""
        if isinstance(w, Adapted):
            return jax.nn.silu(gate) * adapted_product("td,df->tf", x, w, live)
        return self.gated_product(x, w, gate, live)

    def head(self, x: jax.Array, w: jax.Array, tied: bool) -> jax.Array:
        """The vocabulary projection, float32 logits [T, V]."""
        return self.head_product(x, w, tied).astype(jnp.float32)


def xla_product(eq: str, x: jax.Array, w: jax.Array, live: jax.Array | None = None
                ) -> jax.Array:
    return zero_past(jnp.einsum(eq, x, w), live)


def xla_residual_product(eq: str, x: jax.Array, w: jax.Array, residual: jax.Array,
                         live: jax.Array | None = None) -> jax.Array:
    return residual + xla_product(eq, x, w, live)


def xla_gated_product(x: jax.Array, w: jax.Array, gate: jax.Array,
                      live: jax.Array | None = None) -> jax.Array:
    return jax.nn.silu(gate) * xla_product("td,df->tf", x, w, live)


def xla_head_product(x: jax.Array, w: jax.Array, tied: bool) -> jax.Array:
    # Contract against embed [V, D] directly: writing ``embed.T`` makes XLA's CPU backend
    # copy the whole transposed table on every call.
    eq = "td,vd->tv" if tied else "td,dv->tv"
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)


XLA = Projection("xla", xla_product, xla_residual_product, xla_gated_product,
                 xla_head_product)
