"""Rotary position embeddings as lookup tables, and the key re-rotation used by repos.

Angles follow transformers exactly: ``theta(p) = float32(inv_freq_f32 * p)``; cos and sin of
that float32 angle are taken in float64 on the host and stored as float32 tables indexed by
integer position. Two consequences matter for AKV:

* ``rope(k, p)`` equals transformers' ``apply_rotary_pos_emb`` to float32 rounding;
* repos ``K' = R(q) R(p)^-1 K`` is two table rotations, so ``rotate(rope(k, p), p -> q)``
  equals ``rope(k, q)`` to ~1e-7 at any position (a float32 ``delta * inv_freq`` would lose
  ~1e-3 rad at 32k).

The layout is half-split (transformers' ``rotate_half``). No attention scaling factor is
applied: the tables are pure rotations.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.model.config import ModelConfig, RopeConfig


def hf_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 inverse frequencies computed the way transformers computes them."""
    if rope.rope_type == "default":
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
            head_dim
        )
        return (np.float32(1.0) / np.power(np.float32(rope.theta), exponent)).astype(np.float32)
    return rope.inv_freq(head_dim).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RopeTable:
    cos: jax.Array  # [max_pos, head_dim // 2] float32
    sin: jax.Array  # [max_pos, head_dim // 2] float32

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]


def make_rope_table(rope: RopeConfig, head_dim: int, max_positions: int) -> RopeTable:
    inv = hf_inv_freq(rope, head_dim)
    pos = np.arange(max_positions, dtype=np.float32)
    angle = (pos[:, None] * inv[None, :]).astype(np.float32).astype(np.float64)
    return RopeTable(
        cos=jnp.asarray(np.cos(angle), jnp.float32), sin=jnp.asarray(np.sin(angle), jnp.float32)
    )


def rope_table_for(cfg: ModelConfig, max_positions: int | None = None) -> RopeTable:
    return make_rope_table(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate half-split pairs of ``x`` [..., T, H, Dh] by angles with cos/sin [..., T, Dh/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[..., None, :], sin[..., None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, table: RopeTable) -> jax.Array:
    """``x`` [T, H, Dh] at integer ``positions`` [T]."""
    return _rotate(x, table.cos[positions], table.sin[positions])


def rerotate(x: jax.Array, old_pos: jax.Array, new_pos: jax.Array, table: RopeTable) -> jax.Array:
    """``R(new) R(old)^-1 x`` for keys ``x`` [T, H, Dh] (the repos rotation), in float32."""
    c_old, s_old = table.cos[old_pos], table.sin[old_pos]
    c_new, s_new = table.cos[new_pos], table.sin[new_pos]
    # Combined angle theta(new) - theta(old) by the difference formulas, in float32.
    cos = c_new * c_old + s_new * s_old
    sin = s_new * c_old - c_new * s_old
    return _rotate(x, cos, sin)
