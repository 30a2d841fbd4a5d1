"""The model configuration schema: :class:`ModelConfig` and its :class:`RopeConfig`.

Only what the forward pass needs is kept, whatever the checkpoint's format. Reading (and
writing) a Hugging Face ``config.json`` is :mod:`akv_jax.model.hf_config`; the released models'
shapes and the tiny random test models are :mod:`akv_jax.model.presets`; RoPE frequencies and
tables are computed from a :class:`RopeConfig` by :mod:`akv_jax.model.rope`.
"""

from __future__ import annotations

import dataclasses
import math

MODEL_TYPES = ("llama", "qwen3", "gpt_oss", "minimax_m2", "qwen3_moe")
# transformers' GptOssConfig defaults for fields the released config.json does not carry.
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_SWIGLU_LIMIT = 7.0
LAYER_TYPES = ("full_attention", "sliding_attention")


class ConfigError(ValueError):
    """A config.json that akv_jax cannot serve (unknown architecture, missing field)."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """A model's RoPE parameters (transformers' ``rope_parameters``); the frequencies they
    give are :func:`akv_jax.model.rope.hf_inv_freq`'s."""

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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the forward pass needs of a model's config, whatever its checkpoint format."""

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
