"""Sums over a row's last axis whose bits do not depend on the rows beside it.

XLA:CPU vectorises a reduction across rows by the array's shape, so the same row summed in
a batch of 20 rows or of 276 (or at another offset) may round differently; a norm, a
softmax or a log-softmax over it then changes bits with the batch (issue 38). Here the sum
is a fixed pairwise tree of element-wise adds, which every row evaluates alike. Other
platforms keep their own reduction (``jax.lax.platform_dependent``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pairwise_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis as a fixed pairwise tree: halves added element-wise, an odd
    last element carried to the next level."""
    while x.shape[-1] > 1:
        n = x.shape[-1]
        h = n // 2
        y = x[..., :h] + x[..., h : 2 * h]
        x = jnp.concatenate([y, x[..., 2 * h :]], axis=-1) if n % 2 else y
    return x[..., 0]


def row_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """``jnp.sum(x, axis=-1)``, on the CPU a row-invariant :func:`pairwise_sum`."""
    out = jax.lax.platform_dependent(
        x, cpu=pairwise_sum, default=lambda x: jnp.sum(x, axis=-1)
    )
    return out[..., None] if keepdims else out


def row_mean(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """``jnp.mean(x, axis=-1)`` from :func:`row_sum`."""
    return row_sum(x, keepdims) / x.shape[-1]


def row_max(x: jax.Array) -> jax.Array:
    """``jnp.max(x, axis=-1, keepdims=True)`` (exact in any order), kept out of the fusion of
    what follows: XLA:CPU fused into the reduction evaluates ``exp(x - max)`` with other
    bits than the same exp on its own, and differently by the array's shape."""
    return jax.lax.optimization_barrier(jnp.max(x, axis=-1, keepdims=True))


def row_logsumexp(x: jax.Array) -> jax.Array:
    """``log(sum(exp(x)))`` over the last axis, shifted by the row's maximum."""
    m = row_max(x)
    return m[..., 0] + jnp.log(row_sum(jnp.exp(x - m)))


def row_softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.softmax(x, axis=-1)`` from :func:`row_max` and :func:`row_sum`."""
    e = jnp.exp(x - row_max(x))
    return e / row_sum(e, keepdims=True)
