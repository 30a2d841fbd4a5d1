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
    "GptOssForCausalLM": "gpt_oss",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MODEL_TYPES = ("llama", "qwen3", "gpt_oss", "minimax_m2", "qwen3_moe")
# transformers' GptOssConfig defaults for fields the released config.json does not carry.
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_SWIGLU_LIMIT = 7.0
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' per-model ``default_theta`` where config.json gives none.
DEFAULT_THETA = {"gpt_oss": 150000.0, "minimax_m2": 5000000.0}


class ConfigError(ValueError):
    """A config.json that akv_jax cannot serve (unknown architecture, missing field)."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default", "llama3" or "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN only (transformers' _compute_yarn_parameters).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # None: derived from factor / mscale
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos *and* sin by (1.0 except for YaRN)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(
                get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
            )
        return get_mscale(self.factor)

    def yarn_inv_freq(self, head_dim: int) -> np.ndarray:
        """float32 YaRN inverse frequencies, op for op as transformers computes them."""
        f32 = np.float32
        base, dim = self.theta, head_dim

        def correction_dim(rot: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rot * 2 * math.pi))) / (
                2 * math.log(base)
            )

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        exponent = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
        # torch's float32 pow is closer to a float64 pow rounded once than to numpy's float32
        # pow (which is 1-2 ulp off it at a few exponents).
        pos_freqs = np.power(np.float64(base), exponent.astype(np.float64)).astype(f32)
        extrapolation = (f32(1.0) / pos_freqs).astype(f32)
        interpolation = (f32(1.0) / (f32(self.factor) * pos_freqs)).astype(f32)
        ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
        extra_factor = (f32(1.0) - ramp.astype(f32)).astype(f32)
        return (
            interpolation * (f32(1.0) - extra_factor) + extrapolation * extra_factor
        ).astype(f32)

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
        elif self.rope_type == "yarn":
            inv = self.yarn_inv_freq(head_dim).astype(np.float64)
        elif self.rope_type != "default":
            raise ConfigError(f"unsupported rope_type {self.rope_type!r}")
        return inv


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama", "qwen3", "gpt_oss", "minimax_m2" or "qwen3_moe"
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
    # Per-layer attention kind ("full_attention" / "sliding_attention"); None: all full.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    # Mixture of experts (GPT-OSS): 0 experts means the dense SwiGLU MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = GPT_OSS_SWIGLU_ALPHA
    swiglu_limit: float = GPT_OSS_SWIGLU_LIMIT
    # Partial rotary (MiniMax-M2): only the first ``rotary_dim`` dims of each q/k head rotate
    # (transformers' ``int(head_dim * partial_rotary_factor)``); None: all of them.
    rotary_dim: int | None = None
    # Qwen3-MoE: expert width (None: ``intermediate_size``, as GPT-OSS), renormalised top-k
    # weights, and which layers keep the dense MLP (transformers' Qwen3MoeDecoderLayer rule).
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3_moe")

    @property
    def expert_width(self) -> int:
        """The FFN width of one expert (``moe_intermediate_size``, else ``intermediate_size``)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def moe_bias(self) -> bool:
        """Router and expert biases (GPT-OSS); Qwen3-MoE has none."""
        return self.arch == "gpt_oss"

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` runs the experts (else the dense SwiGLU MLP of width
        ``intermediate_size``). Qwen3-MoE: not in ``mlp_only_layers`` and ``(i + 1)`` a
        multiple of ``decoder_sparse_step``, as transformers decides."""
        if not self.is_moe:
            return False
        if self.arch == "qwen3_moe":
            return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        return True

    def mlp_layers(self, moe: bool) -> tuple[int, ...]:
        """The layers whose MLP is MoE (``moe``) or dense, ascending: the rows of the params'
        expert (or dense MLP) stacks."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i) == moe)

    @property
    def qk_norm_over_heads(self) -> bool:
        """MiniMax-M2's q/k RMSNorm: over the whole projection (all heads, weight [H*Dh])."""
        return self.arch == "minimax_m2"

    @property
    def rope_dim(self) -> int:
        """How many leading dims of a head rotate (head_dim unless partial rotary)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def sigmoid_router(self) -> bool:
        """MiniMax-M2's router: sigmoid scores, top-k chosen on scores plus
        ``e_score_correction_bias``, the chosen scores renormalised; experts
        ``silu(gate) * up`` with no biases."""
        return self.arch == "minimax_m2"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_sinks(self) -> bool:
        return self.arch == "gpt_oss"

    @property
    def norm_scale_in_float32(self) -> bool:
        """GPT-OSS's RMSNorm scales before casting back; Llama's casts, then scales."""
        return self.arch == "gpt_oss"

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types is not None else "full_attention"

    def window_for(self, layer_type: str) -> int | None:
        return self.sliding_window if layer_type == "sliding_attention" else None

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
        if self.rope.rope_type == "yarn":
            rope.update(
                factor=self.rope.factor,
                beta_fast=self.rope.beta_fast,
                beta_slow=self.rope.beta_slow,
                truncate=self.rope.truncate,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self.rope, key) is not None:
                    rope[key] = getattr(self.rope, key)
        eos = list(self.eos_token_ids)
        out = {
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
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
            out["sliding_window"] = self.sliding_window
        if self.is_moe and self.arch == "minimax_m2":
            out.update(
                num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok
            )
            if self.rotary_dim is not None:
                rope["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        elif self.arch == "qwen3_moe":
            out.update(
                num_experts=self.num_experts,  # the released config.json's spelling
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.expert_width,
                norm_topk_prob=self.norm_topk_prob,
                mlp_only_layers=list(self.mlp_only_layers),
                decoder_sparse_step=self.decoder_sparse_step,
                use_sliding_window=False,
            )
        elif self.is_moe:
            out.update(
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                swiglu_alpha=self.swiglu_alpha,
                swiglu_limit=self.swiglu_limit,
            )
        return out


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


def tiny_config(arch: str = "qwen3", vocab_size: int = 512) -> ModelConfig:
    """The small random model behind ``--model-path tiny`` (every dimension distinct), or
    with ``arch="gpt_oss"`` the one behind ``tiny-gpt-oss`` (:func:`tiny_gpt_oss_config`),
    with ``arch="minimax_m2"`` ``tiny-minimax-m2`` (:func:`tiny_minimax_m2_config`)."""
    if arch == "gpt_oss":
        return tiny_gpt_oss_config(vocab_size)
    if arch == "minimax_m2":
        return tiny_minimax_m2_config(vocab_size)
    if arch == "qwen3_moe":
        return tiny_qwen3_moe_config(vocab_size)
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


def tiny_gpt_oss_config(vocab_size: int = 512) -> ModelConfig:
    """``--model-path tiny-gpt-oss``: sliding/full layers alternating, a window of 8 (shorter
    than any test prompt), 6 experts top-2, released YaRN rope (factor 32)."""
    return ModelConfig(
        arch="gpt_oss",
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=40,
        num_layers=4,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope=RopeConfig(
            theta=150000.0,
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=256,
        ),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=True,
        eos_token_ids=(vocab_size - 1,),
        layer_types=("sliding_attention", "full_attention") * 2,
        sliding_window=8,
        num_experts=6,
        num_experts_per_tok=2,
    )


def tiny_minimax_m2_config(vocab_size: int = 512) -> ModelConfig:
    """``--model-path tiny-minimax-m2``: 6 experts top-2 with the sigmoid router, q/k norm
    over all heads, half the head dims rotary (as released: 64 of 128), theta 5e6."""
    return ModelConfig(
        arch="minimax_m2",
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=40,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=5000000.0),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        # The released ids (200034 / 200020) lie outside a tiny vocabulary: the tokenizer's
        # ``]~!b[`` and ``[e~[`` (ChatTokenizer.byte_level_minimax_m2) instead.
        bos_token_id=vocab_size - 3,
        eos_token_ids=(vocab_size - 1,),
        num_experts=6,
        num_experts_per_tok=2,
        rotary_dim=8,
    )



def tiny_qwen3_moe_config(vocab_size: int = 512) -> ModelConfig:
    """``--model-path tiny-qwen3-moe``: 4 layers, dense MLP and experts alternating
    (``decoder_sparse_step`` 2), 6 experts of width 24 top-2 renormalised, q/k norms."""
    return ModelConfig(
        arch="qwen3_moe",
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=80,
        num_layers=4,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_ids=(vocab_size - 1,),
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        decoder_sparse_step=2,
    )


def tiny_gpt_oss_bpe_config() -> ModelConfig:
    """``--model-path tiny-gpt-oss-bpe``: :func:`tiny_gpt_oss_config` over GPT-OSS's real
    vocabulary (o200k_harmony, 201,088 ids) with its EOS ids, as its generation_config.json:
    ``<|return|>``, ``<|endoftext|>``, ``<|call|>``."""
    return dataclasses.replace(tiny_gpt_oss_config(201088), eos_token_ids=(200002, 199999, 200012))


def tiny_qwen3_moe_bpe_config() -> ModelConfig:
    """``--model-path tiny-qwen3-moe-bpe``: :func:`tiny_qwen3_moe_config` over Qwen3's real
    vocabulary, padded to 151,936 ids as the released Qwen3 checkpoints are, with their EOS ids
    (generation_config.json): ``<|im_end|>``, ``<|endoftext|>``."""
    return dataclasses.replace(tiny_qwen3_moe_config(151936), eos_token_ids=(151645, 151643))


# The released models' shapes (their Hugging Face config.json, abridged), for shape-only work:
# deviceless compiles, memory plans and benchmarks with random weights. Serving a real
# checkpoint reads its own config.json instead.
def _smollm2_135m() -> ModelConfig:
    return ModelConfig(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0), max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    )


def _qwen3_8b() -> ModelConfig:
    return ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0), max_position_embeddings=40960,
        tie_word_embeddings=False, eos_token_ids=(151645,),
    )


def _gpt_oss(num_layers: int, num_experts: int) -> ModelConfig:
    return ModelConfig(
        arch="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_layers=num_layers, num_heads=64, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=150000.0, rope_type="yarn", factor=32.0, beta_fast=32.0,
                        beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=True,
        eos_token_ids=(200002, 199999, 200012),
        layer_types=("sliding_attention", "full_attention") * (num_layers // 2),
        sliding_window=128, num_experts=num_experts, num_experts_per_tok=4,
    )


PRESETS = {
    "SmolLM2-135M": _smollm2_135m,
    "Qwen3-8B": _qwen3_8b,
    "GPT-OSS-20B": lambda: _gpt_oss(24, 32),
    "GPT-OSS-120B": lambda: _gpt_oss(36, 128),
}


def preset_config(name: str) -> ModelConfig:
    """The shapes of a released model by name (a key of :data:`PRESETS`)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]()
