"""RoPE tables and the rotations read from them: the rotary math every layer shares.

A :class:`RopeTable` holds float32 cos/sin indexed by integer position (built from a model's
config by :func:`akv_jax.model.rope.rope_table_for`). Two rotations use it:

* :func:`apply_rope`: rotate keys or queries to their positions (the model's forward);
* :func:`rerotate`: the repos rotation ``K' = R(new) R(old)^-1 K`` of stored keys (cache ops,
  the repos reference and kernel, the server's re-rotated copies). Its angle is formed by
  :func:`rotation_tables` from the table's float32 cos/sin at both positions by the
  difference formulas, so ``rerotate(rope(k, p), p, q) == rope(k, q)`` to ~1e-7 at any
  position (a float32 ``delta * inv_freq`` angle would lose ~1e-3 rad at 32k).

The layout is half-split (transformers' ``rotate_half``). Partial rotary (MiniMax-M2,
``partial_rotary_factor`` < 1; DESIGN §2.1) is the table's width: a table of ``r/2`` columns
rotates the first ``r`` dims of each head (half-split within them, as transformers'
``apply_rotary_pos_emb`` slices ``[..., :rotary_dim]``) and passes the others through
bit for bit, in append and in repos alike. This module sits at the bottom of
the package layers (it imports only jax), so the kernels, the model and the cache all share
one statement of each rotation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RopeTable:
    cos: jax.Array  # [max_pos, rotary_dim // 2] float32 (rotary_dim = head_dim unless partial)
    sin: jax.Array  # [max_pos, rotary_dim // 2] float32

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    @property
    def rotary_dim(self) -> int:
        return 2 * self.cos.shape[-1]


def rotate_half_split(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate half-split pairs of ``x`` [..., T, H, Dh] by angles with cos/sin [..., T, r/2],
    in float32; the result has ``x``'s dtype. Only the first ``r`` dims rotate (``r`` < Dh:
    partial rotary); the rest pass through unchanged."""
    half = cos.shape[-1]
    if 2 * half > x.shape[-1]:
        raise ValueError(f"rotary table of {2 * half} dims for heads of {x.shape[-1]}")
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half : 2 * half].astype(jnp.float32)
    out = jnp.concatenate(rotate_halves(x1, x2, cos[..., None, :], sin[..., None, :]),
                          axis=-1).astype(x.dtype)
    if 2 * half == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., 2 * half :]], axis=-1)


def rotate_halves(x1: jax.Array, x2: jax.Array, c: jax.Array, s: jax.Array,
                  round_products: bool = True) -> tuple[jax.Array, jax.Array]:
    """``(x1 c - x2 s, x2 c + x1 s)``, the rotation of half-split pairs. ``round_products``:
    each product rounded before the sum (XLA contracts ``a * b - c * d`` into a fused
    multiply-add in some fusions and shapes and not in others: a key's bits moved with the
    step's row count under a tensor-parallel mesh); off inside a compiled Pallas kernel."""
    products = (x1 * c, x2 * s, x2 * c, x1 * s)
    if round_products:
        products = jax.lax.optimization_barrier(products)
    x1c, x2s, x2c, x1s = products
    return x1c - x2s, x2c + x1s


def apply_rope(x: jax.Array, positions: jax.Array, table: RopeTable) -> jax.Array:
    """``x`` [T, H, Dh] at integer ``positions`` [T]."""
    return rotate_half_split(x, table.cos[positions], table.sin[positions])


def rotation_tables(
    old_pos: jax.Array, new_pos: jax.Array, table: RopeTable
) -> tuple[jax.Array, jax.Array]:
    """cos/sin of ``theta(new) - theta(old)`` (shape ``old_pos.shape + (r/2,)``), by the
    difference formulas over the table's float32 cos/sin, in float32."""
    c_old, s_old = table.cos[old_pos], table.sin[old_pos]
    c_new, s_new = table.cos[new_pos], table.sin[new_pos]
    return c_new * c_old + s_new * s_old, s_new * c_old - c_new * s_old


def rerotate(x: jax.Array, old_pos: jax.Array, new_pos: jax.Array, table: RopeTable) -> jax.Array:
    """``R(new) R(old)^-1 x`` for keys ``x`` [T, H, Dh] (the repos rotation), in float32."""
    return rotate_half_split(x, *rotation_tables(old_pos, new_pos, table))
