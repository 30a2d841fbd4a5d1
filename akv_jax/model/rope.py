"""RoPE frequencies and the tables built from them (:func:`rope_table_for`).

Every inverse frequency is computed here from a model's :class:`RopeConfig`
(:func:`hf_inv_freq`: default, Llama 3 and YaRN scaling, as transformers'
``_compute_*_parameters``). Angles follow transformers exactly:
``theta(p) = float32(inv_freq_f32 * p)``; cos and sin of that float32 angle are taken in
float64 on the host and stored as float32 tables indexed by integer position, so
``rope(k, p)`` equals transformers' ``apply_rotary_pos_emb`` to float32 rounding.
The table type and the rotations that read it (``apply_rope``, the repos ``rerotate``) are in
:mod:`akv_jax.pallas.rotary`, below both the model and the kernels.

No attention scaling factor is applied: the tables are pure rotations. YaRN's attention factor
(:meth:`RopeConfig.attention_scaling`) is applied by the forward when it rotates q and k
(``forward.rope_scaled``), as transformers does, so stored keys carry it exactly once and the
repos rotation by these unscaled tables moves them exactly (DESIGN §2.1). A partial rotary
model's table covers its rotary dims only (``cfg.rope_dim``): the rotations then leave the
other dims alone (:mod:`akv_jax.pallas.rotary`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from akv_jax.model.config import ConfigError, ModelConfig, RopeConfig
from akv_jax.pallas.rotary import RopeTable


def hf_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 inverse frequencies computed the way transformers computes them."""
    if rope.rope_type == "default":
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
            head_dim
        )
        return (np.float32(1.0) / np.power(np.float32(rope.theta), exponent)).astype(np.float32)
    if rope.rope_type == "llama3":
        return llama3_inv_freq(rope, head_dim).astype(np.float32)
    if rope.rope_type == "yarn":
        return yarn_inv_freq(rope, head_dim)
    raise ConfigError(f"unsupported rope_type {rope.rope_type!r}")


def llama3_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Llama 3's scaled inverse frequencies (float64), by the same piecewise rule as
    transformers' ``_compute_llama3_parameters``."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled)


def yarn_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 YaRN inverse frequencies, op for op as transformers computes them."""
    f32 = np.float32
    base, dim = rope.theta, head_dim

    def correction_dim(rot: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rot * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
    # torch's float32 pow is closer to a float64 pow rounded once than to numpy's float32
    # pow (which is 1-2 ulp off it at a few exponents).
    pos_freqs = np.power(np.float64(base), exponent.astype(np.float64)).astype(f32)
    extrapolation = (f32(1.0) / pos_freqs).astype(f32)
    interpolation = (f32(1.0) / (f32(rope.factor) * pos_freqs)).astype(f32)
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    extra_factor = (f32(1.0) - ramp.astype(f32)).astype(f32)
    return (
        interpolation * (f32(1.0) - extra_factor) + extrapolation * extra_factor
    ).astype(f32)


def make_rope_table(rope: RopeConfig, head_dim: int, max_positions: int) -> RopeTable:
    """cos/sin of ``float32(inv_freq * p)`` for positions ``0..max_positions-1``."""
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
