"""Model configuration read from a Hugging Face ``config.json``.

Both the transformers-5 form (``rope_parameters``) and the legacy one (``rope_theta`` plus
``rope_scaling``) are understood. Only what the forward pass needs is kept.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


class ConfigError(ValueError):
    """A config.json that akv_jax cannot serve (unknown architecture, missing field)."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies (float64 numpy) for the half-split RoPE layout."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        if self.rope_type == "llama3":
            # Same piecewise rule as transformers' _compute_llama3_parameters.
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(is_medium, smoothed, scaled)
        elif self.rope_type != "default":
            raise ConfigError(f"unsupported rope_type {self.rope_type!r}")
        return inv


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that :func:`config_from_hf` reads back to this config."""
        arch_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.arch]
        rope: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type == "llama3":
            rope.update(
                factor=self.rope.factor,
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        eos = list(self.eos_token_ids)
        return {
            "architectures": [arch_name],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
        }


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if params is None:  # legacy form
        params = dict(cfg.get("rope_scaling") or {})
        if "rope_theta" in cfg:
            params.setdefault("rope_theta", cfg["rope_theta"])
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    out = RopeConfig(theta=float(params.get("rope_theta", 10000.0)), rope_type=rope_type)
    if rope_type == "llama3":
        out = dataclasses.replace(
            out,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    elif rope_type != "default":
        raise ConfigError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
    return out


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from a parsed Hugging Face config.json."""
    archs = cfg.get("architectures") or []
    arch = None
    for name in archs:
        arch = SUPPORTED_ARCHITECTURES.get(name)
        if arch:
            break
    if arch is None:
        arch = {"llama": "llama", "qwen3": "qwen3"}.get(cfg.get("model_type", ""))
    if arch is None:
        raise ConfigError(
            f"unknown architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):  # the forward's MLP is SwiGLU
        raise ConfigError(f"unsupported hidden_act {act!r} (supported: silu)")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from None


def tiny_config(arch: str = "qwen3", vocab_size: int = 512) -> ModelConfig:
    """The small random model behind ``--model-path tiny`` (every dimension distinct)."""
    return ModelConfig(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=80,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_ids=(vocab_size - 1,),
    )
