"""Hugging Face ``config.json`` to :class:`~akv_jax.model.config.ModelConfig` and back.

Both the transformers-5 form (``rope_parameters``) and the legacy one (``rope_theta`` plus
``rope_scaling``) are read, with transformers' per-model defaults where a field is absent;
:func:`config_to_hf` writes the form :func:`config_from_hf` reads back (a converted
checkpoint's config.json).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from akv_jax.model.config import (
    GPT_OSS_SWIGLU_ALPHA,
    GPT_OSS_SWIGLU_LIMIT,
    LAYER_TYPES,
    MODEL_TYPES,
    ConfigError,
    ModelConfig,
    RopeConfig,
)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "GptOssForCausalLM": "gpt_oss",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# transformers' per-model ``default_theta`` where config.json gives none.
DEFAULT_THETA = {"gpt_oss": 150000.0, "minimax_m2": 5000000.0}


def _rope_from_hf(cfg: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if params is None:  # legacy form
        params = dict(cfg.get("rope_scaling") or {})
        if "rope_theta" in cfg:
            params.setdefault("rope_theta", cfg["rope_theta"])
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    out = RopeConfig(theta=float(params.get("rope_theta", default_theta)), rope_type=rope_type)
    if rope_type == "llama3":
        out = dataclasses.replace(
            out,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    elif rope_type == "yarn":
        def opt(key: str) -> float | None:
            return None if params.get(key) is None else float(params[key])

        out = dataclasses.replace(
            out,
            factor=float(params["factor"]),
            # transformers: ``get("beta_fast") or 32``, ``get("truncate", True)``
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            attention_factor=opt("attention_factor"),
            mscale=opt("mscale"),
            mscale_all_dim=opt("mscale_all_dim"),
        )
    elif rope_type != "default":
        raise ConfigError(
            f"unsupported rope_type {rope_type!r} (supported: default, llama3, yarn)"
        )
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
        model_type = cfg.get("model_type", "")
        arch = model_type if model_type in MODEL_TYPES else None
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
        extra = (
            _gpt_oss_fields(cfg) if arch == "gpt_oss"
            else _qwen3_moe_fields(cfg) if arch == "qwen3_moe" else {}
        )
        if arch == "minimax_m2":
            extra = _minimax_m2_fields(cfg, int(cfg.get("head_dim") or hidden // num_heads))
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
            rope=_rope_from_hf(cfg, DEFAULT_THETA.get(arch, 10000.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "gpt_oss")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **extra,
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from None


def _gpt_oss_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The GPT-OSS-only fields, with transformers' GptOssConfig defaults where absent."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"layer_types must be {n} of {LAYER_TYPES}, got {types!r}")
    window = cfg.get("sliding_window", 128)
    if "sliding_attention" in types and not window:
        raise ConfigError("sliding_attention layers need a sliding_window")
    experts = int(cfg.get("num_local_experts", cfg.get("num_experts", 0)))
    top_k = int(cfg.get("num_experts_per_tok", 0))
    if not 0 < top_k <= experts:
        raise ConfigError(f"num_experts_per_tok {top_k} must be in 1..num_local_experts {experts}")
    return dict(
        layer_types=tuple(types),
        sliding_window=None if window is None else int(window),
        num_experts=experts,
        num_experts_per_tok=top_k,
        swiglu_alpha=float(cfg.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)),
        swiglu_limit=float(cfg.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT)),
    )


def _minimax_m2_fields(cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The MiniMax-M2-only fields: experts, and the rotary width as transformers derives it
    (``partial_rotary_factor`` from ``rope_parameters``, else the top level, else
    ``rotary_dim / head_dim``; ``int(head_dim * factor)`` dims rotate)."""
    experts = int(cfg.get("num_local_experts", cfg.get("num_experts", 0)))
    top_k = int(cfg.get("num_experts_per_tok", 0))
    if not 0 < top_k <= experts:
        raise ConfigError(f"num_experts_per_tok {top_k} must be in 1..num_local_experts {experts}")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor is None and cfg.get("rotary_dim") is not None:
        factor = int(cfg["rotary_dim"]) / head_dim
    rotary = head_dim if factor is None else int(head_dim * float(factor))
    if not (0 < rotary <= head_dim and rotary % 2 == 0):
        raise ConfigError(
            f"partial rotary: {rotary} rotary dims of head_dim {head_dim} (need an even "
            f"number in 2..head_dim)"
        )
    if cfg.get("use_qk_norm") is False:
        raise ConfigError("MiniMax-M2 without use_qk_norm is not supported")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        rotary_dim=None if rotary == head_dim else rotary,
    )


def _qwen3_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3-MoE fields, with transformers' Qwen3MoeConfig defaults where absent. The
    released config.json says ``num_experts``; transformers 5 saves ``num_local_experts``."""
    if cfg.get("use_sliding_window"):
        raise ConfigError("qwen3_moe with use_sliding_window is not supported")
    n = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
    top_k = int(cfg.get("num_experts_per_tok", 8))
    if not 0 < top_k <= experts:
        raise ConfigError(f"num_experts_per_tok {top_k} must be in 1..num_experts {experts}")
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise ConfigError(f"decoder_sparse_step must be >= 1, got {step}")
    only = tuple(sorted({int(i) for i in (cfg.get("mlp_only_layers") or [])}))
    if any(not 0 <= i < n for i in only):
        raise ConfigError(f"mlp_only_layers {list(only)} must be layer indices below {n}")
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        mlp_only_layers=only,
        decoder_sparse_step=step,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A config.json that :func:`config_from_hf` reads back to ``cfg``."""
    arch_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[cfg.arch]
    rope: dict[str, Any] = {"rope_type": cfg.rope.rope_type, "rope_theta": cfg.rope.theta}
    if cfg.rope.rope_type == "llama3":
        rope.update(
            factor=cfg.rope.factor,
            low_freq_factor=cfg.rope.low_freq_factor,
            high_freq_factor=cfg.rope.high_freq_factor,
            original_max_position_embeddings=cfg.rope.original_max_position_embeddings,
        )
    if cfg.rope.rope_type == "yarn":
        rope.update(
            factor=cfg.rope.factor,
            beta_fast=cfg.rope.beta_fast,
            beta_slow=cfg.rope.beta_slow,
            truncate=cfg.rope.truncate,
            original_max_position_embeddings=cfg.rope.original_max_position_embeddings,
        )
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(cfg.rope, key) is not None:
                rope[key] = getattr(cfg.rope, key)
    eos = list(cfg.eos_token_ids)
    out = {
        "architectures": [arch_name],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    if cfg.layer_types is not None:
        out["layer_types"] = list(cfg.layer_types)
        out["sliding_window"] = cfg.sliding_window
    if cfg.is_moe and cfg.arch == "minimax_m2":
        out.update(
            num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok
        )
        if cfg.rotary_dim is not None:
            rope["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    elif cfg.arch == "qwen3_moe":
        out.update(
            num_experts=cfg.num_experts,  # the released config.json's spelling
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.expert_width,
            norm_topk_prob=cfg.norm_topk_prob,
            mlp_only_layers=list(cfg.mlp_only_layers),
            decoder_sparse_step=cfg.decoder_sparse_step,
            use_sliding_window=False,
        )
    elif cfg.is_moe:
        out.update(
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            swiglu_alpha=cfg.swiglu_alpha,
            swiglu_limit=cfg.swiglu_limit,
        )
    return out
