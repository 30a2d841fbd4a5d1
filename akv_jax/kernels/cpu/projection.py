"""The CPU projection backend: :data:`CPU`, a :class:`~akv_jax.kernels.projection.Projection`
whose products run the C++ kernels of :mod:`akv_jax.kernels.cpu.matmul` where they apply
(float32 rows: a decode step's few, a prefill's many; outside a tensor-parallel mesh) and
XLA's products elsewhere, with the same bits as those kernels wherever they run. Under a
tensor-parallel mesh the kernels run on each device's shards (:mod:`.per_shard`).

Its layout: plain weights, or a stack packed for the GEMM once (:func:`pack_stack`, a
:class:`PackedStack`), which every step's layer scan reads in place: each layer's projections
get the stack and the layer's row (:class:`PackedRef`), so neither XLA (a dynamic slice that
feeds a custom call is a copy on XLA:CPU) nor the kernel (its own packing) copies a weight
per call. The packed GEMM takes every row count, a decode step's few included; where it does
not apply (a tensor-parallel mesh) the layer is unpacked: the same bits either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from akv_jax.kernels.cpu import matmul, per_shard
from akv_jax.kernels.projection import (
    LayerIndexed,
    Projection,
    xla_head_product,
    zero_past,
)


@dataclasses.dataclass(frozen=True)
class PackedRef:
    """One layer of a :class:`PackedStack`: ``panels`` [L, P, K, NR], the layer's row
    ``layer`` (int32 scalar) and the layer's weight shape [in..., out...]."""

    panels: jax.Array
    layer: jax.Array
    shape: tuple[int, ...]


jax.tree_util.register_dataclass(PackedRef, data_fields=["panels", "layer"],
                                 meta_fields=["shape"])


@dataclasses.dataclass(frozen=True)
class PackedStack(LayerIndexed):
    """A float32 projection weight of every layer of its kind, packed for the GEMM:
    ``panels`` [L', P, K, NR] (:func:`~akv_jax.kernels.cpu.matmul.pack_panels`), ``rows``
    each model layer's row in the stack (0 for a layer without the weight: never read), and
    ``shape`` one layer's weight shape [in..., out...]."""

    panels: jax.Array
    rows: tuple[int, ...]
    shape: tuple[int, ...]

    def at(self, layer: jax.Array) -> PackedRef:
        return PackedRef(self.panels, jnp.asarray(self.rows, jnp.int32)[layer], self.shape)


jax.tree_util.register_dataclass(PackedStack, data_fields=["panels"],
                                 meta_fields=["rows", "shape"])


def pack_stack(w: jax.Array, n_in: int, rows: Sequence[int]) -> PackedStack | None:
    """The weight stack ``w`` [L', in..., out...] (its first ``n_in`` axes after the layer's
    contracted) packed for the GEMM, with ``rows`` (model layer -> row of ``w``); None where
    ``w`` is not float32 or the packed GEMM is not built. Exact (a copy)."""
    if not (isinstance(w, jax.Array) and w.dtype == jnp.float32 and matmul.packs()):
        return None
    k = int(np.prod(w.shape[1 : 1 + n_in]))
    panels = matmul.pack_panels(w.reshape(w.shape[0], k, -1))
    return PackedStack(panels, tuple(rows), tuple(w.shape[1:]))


def product(eq: str, x: jax.Array, w, live: jax.Array | None = None) -> jax.Array:
    """``einsum(eq, x, w)``: the few-row kernel for a decode step's 2..16 float32 rows (XLA's
    small-GEMM path is compute-bound where they should run at the memory's speed), the GEMM
    for a prefill's many (its rows do not depend on the batch around them, and it skips the
    rows from ``live`` on), XLA's einsum otherwise. ``w`` may be a :class:`PackedRef`."""
    if isinstance(w, PackedRef):
        x2 = x.reshape(x.shape[0], -1)
        n = int(np.prod(w.shape)) // x2.shape[1]
        if matmul.applies_packed(x2, w.panels):
            y = matmul.matmul_packed(x2, w.panels, w.layer, n, live)
            return y.reshape(x.shape[0], *w.shape[x.ndim - 1 :])
        w = matmul.unpack_panels(w.panels, w.layer, n).reshape(w.shape)
    y = per_shard.sharded_product(eq, x, w, live, product)
    if y is not None:  # a tensor-parallel mesh: this function on each device's shards
        return y
    xs, rest = eq.split(",")
    ws, out = rest.split("->")
    n_in = x.ndim - 1
    # x [T, in...] and w [in..., out...] in that order: a plain [T, K] @ [K, N].
    if ws[:n_in] == xs[1:] and out == xs[0] + ws[n_in:]:
        x2 = x.reshape(x.shape[0], -1)
        w2 = w.reshape(x2.shape[1], -1)
        if matmul.applies(x2, w2):
            y = matmul.matmul(x2, w2, live)  # zeros past ``live`` already
            return y.reshape(x.shape[0], *w.shape[n_in:])
    return zero_past(jnp.einsum(eq, x, w), live)


def residual_product(eq: str, x: jax.Array, w, residual: jax.Array,
                     live: jax.Array | None = None) -> jax.Array:
    """``residual + product(...)``: from a packed weight the GEMM adds ``residual`` to each
    block as it lands (the bits of the add after the product, without XLA's pass over
    both)."""
    if isinstance(w, PackedRef):
        x2 = x.reshape(x.shape[0], -1)
        if (matmul.applies_packed(x2, w.panels) and residual.dtype == x2.dtype
                and matmul.epilogues()):
            r2 = residual.reshape(x.shape[0], -1)
            y = matmul.matmul_packed(x2, w.panels, w.layer, r2.shape[1], live, residual=r2)
            return y.reshape(residual.shape)
    return residual + product(eq, x, w, live)


def gated_product(x: jax.Array, w, gate: jax.Array, live: jax.Array | None = None
                  ) -> jax.Array:
    """``silu(gate) * (x @ w)``: where :func:`product`'s rows take a kernel the activation is
    the kernel's epilogue (one pass, where XLA read the gate and up outputs back; the same
    bits from every kernel and from packed weights), else XLA's silu."""
    if isinstance(w, PackedRef):
        if matmul.applies_packed(x, w.panels) and matmul.epilogues():
            return matmul.matmul_packed(x, w.panels, w.layer, gate.shape[1], live, gate)
        w = matmul.unpack_panels(w.panels, w.layer, gate.shape[1]).reshape(w.shape)
    if isinstance(w, jax.Array) and matmul.applies_gated(x, w):
        return matmul.matmul_gated(x, w, gate, live)
    return jax.nn.silu(gate) * product("td,df->tf", x, w, live)


def head_product(x: jax.Array, w: jax.Array, tied: bool) -> jax.Array:
    """The vocabulary projection: the few-row kernel for a decode step's float32 rows (tied:
    the embedding as [V, D]), the GEMM for a prefill's many (untied), XLA's product else.
    Under a tensor-parallel mesh (the vocabulary is not split) each device runs it whole."""
    if per_shard.tensor_size() > 1:
        whole = per_shard.per_shard(lambda x, w: head_product(x, w, tied), (P(), P()), P())
        return whole(x, w)
    if tied:
        if matmul.applies_nt(x, w):
            return matmul.matmul_nt(x, w)
    elif matmul.applies(x, w):
        return matmul.matmul(x, w)
    return xla_head_product(x, w, tied)


CPU = Projection("cpu", product, residual_product, gated_product, head_product)
