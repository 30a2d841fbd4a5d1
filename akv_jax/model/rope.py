"""RoPE tables built from a model's config (:func:`rope_table_for`).

Angles follow transformers exactly: ``theta(p) = float32(inv_freq_f32 * p)``; cos and sin of
that float32 angle are taken in float64 on the host and stored as float32 tables indexed by
integer position, so ``rope(k, p)`` equals transformers' ``apply_rotary_pos_emb`` to float32
rounding. The table type and the rotations that read it (``apply_rope``, the repos
``rerotate``) are in :mod:`akv_jax.pallas.rotary`, below both the model and the kernels.

No attention scaling factor is applied: the tables are pure rotations. YaRN's attention factor
(:meth:`RopeConfig.attention_scaling`) is applied by the forward when it rotates q and k
(``forward.rope_scaled``), as transformers does, so stored keys carry it exactly once and the
repos rotation by these unscaled tables moves them exactly (DESIGN §2.1). A partial rotary
model's table covers its rotary dims only (``cfg.rope_dim``): the rotations then leave the
other dims alone (:mod:`akv_jax.pallas.rotary`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from akv_jax.model.config import ModelConfig, RopeConfig
from akv_jax.pallas.rotary import RopeTable


def hf_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 inverse frequencies computed the way transformers computes them."""
    if rope.rope_type == "default":  # (YaRN: RopeConfig.yarn_inv_freq, already float32)
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
            head_dim
        )
        return (np.float32(1.0) / np.power(np.float32(rope.theta), exponent)).astype(np.float32)
    return rope.inv_freq(head_dim).astype(np.float32)


def make_rope_table(rope: RopeConfig, head_dim: int, max_positions: int) -> RopeTable:
    inv = hf_inv_freq(rope, head_dim)
    pos = np.arange(max_positions, dtype=np.float32)
    angle = (pos[:, None] * inv[None, :]).astype(np.float32).astype(np.float64)
    return RopeTable(
        cos=jnp.asarray(np.cos(angle), jnp.float32), sin=jnp.asarray(np.sin(angle), jnp.float32)
    )


def rope_table_for(cfg: ModelConfig, max_positions: int | None = None) -> RopeTable:
    """The table of ``cfg``: ``cfg.rope_dim / 2`` columns (frequencies over the rotary dims
    only, as transformers computes them for a partial rotary factor)."""
    return make_rope_table(cfg.rope, cfg.rope_dim, max_positions or cfg.max_position_embeddings)
