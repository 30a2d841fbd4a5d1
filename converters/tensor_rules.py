"""The table from Hugging Face tensor names to akv_jax params: name patterns, shapes, transforms.

In the style of jax-ml/jax-llm-examples' converters: a table of ``regex -> (param path,
HF shape, transform)`` with the layer index taken from the name (:data:`RULES`). HF ``Linear``
weights are stored ``[out, in]``; akv_jax keeps ``[in, ...out]`` with heads as their own axis,
so the transforms are transposes and reshapes only (values are never changed). Expert weights
a released MXFP4 checkpoint stores packed can also be mapped packed
(:data:`converters.mapping.PACKABLE`): their transforms (identity; gate_up_proj's even / odd
columns, which are whole rows of the packed layout) never decode a value.

Qwen3-MoE and MiniMax-M2 checkpoints store one tensor per expert (Qwen3-MoE's
``mlp.experts.{e}.{gate,up,down}_proj.weight``, MiniMax-M2's
``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, as released and as transformers 5
``save_pretrained`` writes them); the rule's second group is the expert, and the converter
stacks the E tensors into the ``[E, ...]`` expert weights. transformers' in-memory fused layout
(``mlp.experts.gate_up_proj`` ``[E, 2F, D]`` with gate the first half, ``down_proj``
``[E, D, F]``) is accepted too. Those names clash with GPT-OSS's interleaved layout, so they
live in per-architecture rules consulted first (:data:`ARCH_RULES`). Matching a name against
the table is :func:`converters.mapping.hf_target`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from akv_jax.model.config import ModelConfig
from akv_jax.pallas.grouped_matmul import Mxfp4Weight
from converters import mxfp4

# Takes and returns numpy arrays; the transforms of expert weights (identity, even / odd
# columns) also take a packed Mxfp4Weight, which the loader may keep packed.
Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]
# One rule: HF name (regex; group 1 is the layer, group 2 the expert) -> (akv_jax path, HF
# shape from the config, transform).
Rule = tuple[str, str, Callable[[ModelConfig], tuple[int, ...]], Transform]


def _ident(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w


def _t(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return w.T


def _heads_in(n_heads: Callable[[ModelConfig], int]) -> Transform:
    # [H*Dh, D] -> [D, H, Dh]
    return lambda w, cfg: w.T.reshape(cfg.hidden_size, n_heads(cfg), cfg.head_dim)


def _heads_out(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    # [D, Hq*Dh] -> [Hq, Dh, D]
    return w.T.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)


_Q, _KV = (lambda c: c.num_heads), (lambda c: c.num_kv_heads)


def _bias_heads(n_heads: Callable[[ModelConfig], int]) -> Transform:
    # [H*Dh] -> [H, Dh]
    return lambda w, cfg: w.reshape(n_heads(cfg), cfg.head_dim)


def _columns(w: np.ndarray | Mxfp4Weight, columns: slice) -> np.ndarray | Mxfp4Weight:
    """``w[..., columns]`` of the dense layout; a tensor the source keeps packed
    (:class:`Mxfp4Weight` of numpy arrays) gives up whole rows of codes instead."""
    if isinstance(w, Mxfp4Weight):
        return Mxfp4Weight(*mxfp4.select_out(w.blocks, w.scales, columns))
    return np.ascontiguousarray(w[..., columns])


def _even(w: np.ndarray | Mxfp4Weight, cfg: ModelConfig) -> np.ndarray | Mxfp4Weight:
    return _columns(w, slice(0, None, 2))  # HF gate_up_proj: gate in the even columns


def _odd(w: np.ndarray | Mxfp4Weight, cfg: ModelConfig) -> np.ndarray | Mxfp4Weight:
    return _columns(w, slice(1, None, 2))  # ... and up in the odd ones


def _norm_heads(n_heads: Callable[[ModelConfig], int]) -> Transform:
    # MiniMax-M2's q/k norm weight over the whole projection: [H*Dh] -> [H, Dh]
    return lambda w, cfg: w.reshape(n_heads(cfg), cfg.head_dim)


def _experts_t(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(w, -1, -2))  # [E, out, in] -> [E, in, out]


def _first_half_t(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return _experts_t(w[:, : cfg.expert_width], cfg)  # fused gate_up_proj: gate first


def _second_half_t(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return _experts_t(w[:, cfg.expert_width :], cfg)


# The rules every architecture shares.
RULES: list[Rule] = [
    (r"model\.embed_tokens\.weight", "embed", lambda c: (c.vocab_size, c.hidden_size), _ident),
    (r"model\.norm\.weight", "final_norm", lambda c: (c.hidden_size,), _ident),
    (r"lm_head\.weight", "lm_head", lambda c: (c.vocab_size, c.hidden_size), _t),
    (
        r"model\.layers\.(\d+)\.input_layernorm\.weight",
        "layers.attn_norm",
        lambda c: (c.hidden_size,),
        _ident,
    ),
    (
        r"model\.layers\.(\d+)\.post_attention_layernorm\.weight",
        "layers.mlp_norm",
        lambda c: (c.hidden_size,),
        _ident,
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight",
        "layers.wq",
        lambda c: (c.num_heads * c.head_dim, c.hidden_size),
        _heads_in(_Q),
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight",
        "layers.wk",
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
        _heads_in(_KV),
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight",
        "layers.wv",
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
        _heads_in(_KV),
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight",
        "layers.wo",
        lambda c: (c.hidden_size, c.num_heads * c.head_dim),
        _heads_out,
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight",
        "layers.q_norm",
        lambda c: (c.head_dim,),
        _ident,
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight",
        "layers.k_norm",
        lambda c: (c.head_dim,),
        _ident,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight",
        "layers.w_gate",
        lambda c: (c.intermediate_size, c.hidden_size),
        _t,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.up_proj\.weight",
        "layers.w_up",
        lambda c: (c.intermediate_size, c.hidden_size),
        _t,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.down_proj\.weight",
        "layers.w_down",
        lambda c: (c.hidden_size, c.intermediate_size),
        _t,
    ),
    # Attention biases (GPT-OSS; any model whose config sets attention_bias).
    (
        r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias",
        "layers.bq",
        lambda c: (c.num_heads * c.head_dim,),
        _bias_heads(_Q),
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias",
        "layers.bk",
        lambda c: (c.num_kv_heads * c.head_dim,),
        _bias_heads(_KV),
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias",
        "layers.bv",
        lambda c: (c.num_kv_heads * c.head_dim,),
        _bias_heads(_KV),
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.o_proj\.bias",
        "layers.bo",
        lambda c: (c.hidden_size,),
        _ident,
    ),
    # GPT-OSS sinks, router and experts (the dense, unquantised layout transformers saves).
    (r"model\.layers\.(\d+)\.self_attn\.sinks", "layers.sinks", lambda c: (c.num_heads,), _ident),
    (
        r"model\.layers\.(\d+)\.mlp\.router\.weight",
        "layers.router",
        lambda c: (c.num_experts, c.hidden_size),
        _t,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.router\.bias",
        "layers.router_bias",
        lambda c: (c.num_experts,),
        _ident,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj",
        "layers.expert_gate",
        lambda c: (c.num_experts, c.hidden_size, 2 * c.intermediate_size),
        _even,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj_bias",
        "layers.expert_gate_bias",
        lambda c: (c.num_experts, 2 * c.intermediate_size),
        _even,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.down_proj",
        "layers.expert_down",
        lambda c: (c.num_experts, c.intermediate_size, c.hidden_size),
        _ident,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.down_proj_bias",
        "layers.expert_down_bias",
        lambda c: (c.num_experts, c.hidden_size),
        _ident,
    ),
]
# The odd half of an interleaved tensor: param path -> (path it rides with, transform).
EXTRA: dict[str, tuple[tuple[str, Transform], ...]] = {
    "layers.expert_gate": (("layers.expert_up", _odd),),
    "layers.expert_gate_bias": (("layers.expert_up_bias", _odd),),
}

# Qwen3-MoE: its router, and its experts one tensor each or fused.
QWEN3_MOE_RULES: list[Rule] = [
    (
        r"model\.layers\.(\d+)\.mlp\.gate\.weight",
        "layers.router",
        lambda c: (c.num_experts, c.hidden_size),
        _t,
    ),
    # One tensor per expert (released layout and transformers 5's save_pretrained).
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight",
        "layers.expert_gate",
        lambda c: (c.expert_width, c.hidden_size),
        _t,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight",
        "layers.expert_up",
        lambda c: (c.expert_width, c.hidden_size),
        _t,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight",
        "layers.expert_down",
        lambda c: (c.hidden_size, c.expert_width),
        _t,
    ),
    # transformers' fused in-memory layout (save_original_format=False).
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj",
        "layers.expert_gate",
        lambda c: (c.num_experts, 2 * c.expert_width, c.hidden_size),
        _first_half_t,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.down_proj",
        "layers.expert_down",
        lambda c: (c.num_experts, c.hidden_size, c.expert_width),
        _experts_t,
    ),
]

_MM = r"model\.layers\.(\d+)\.block_sparse_moe"
_MM_ANY = r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)"
# MiniMax-M2. Two layouts: the released one, which transformers 5.24's save_pretrained also
# writes (``block_sparse_moe``, one ``w1``/``w3``/``w2`` [out, in] tensor per expert: group 2
# is the expert), and transformers' in-memory one (``mlp.gate``, ``mlp.experts.gate_up_proj``
# [E, 2F, D], gate first, and ``down_proj`` [E, D, F]). The released names come first: error
# messages name a missing tensor by the first rule that fills its param.
MINIMAX_M2_RULES: list[Rule] = [
    (
        r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight",
        "layers.q_norm",
        lambda c: (c.num_heads * c.head_dim,),
        _norm_heads(_Q),
    ),
    (
        r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight",
        "layers.k_norm",
        lambda c: (c.num_kv_heads * c.head_dim,),
        _norm_heads(_KV),
    ),
    (_MM + r"\.gate\.weight", "layers.router", lambda c: (c.num_experts, c.hidden_size), _t),
    (
        _MM + r"\.e_score_correction_bias",
        "layers.router_score_bias",
        lambda c: (c.num_experts,),
        _ident,
    ),
    (
        _MM + r"\.experts\.(\d+)\.w1\.weight",
        "layers.expert_gate",
        lambda c: (c.expert_width, c.hidden_size),
        _t,
    ),
    (
        _MM + r"\.experts\.(\d+)\.w3\.weight",
        "layers.expert_up",
        lambda c: (c.expert_width, c.hidden_size),
        _t,
    ),
    (
        _MM + r"\.experts\.(\d+)\.w2\.weight",
        "layers.expert_down",
        lambda c: (c.hidden_size, c.expert_width),
        _t,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.gate\.weight",
        "layers.router",
        lambda c: (c.num_experts, c.hidden_size),
        _t,
    ),
    (
        _MM_ANY + r"\.(?:gate\.)?e_score_correction_bias",
        "layers.router_score_bias",
        lambda c: (c.num_experts,),
        _ident,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj",
        "layers.expert_gate",
        lambda c: (c.num_experts, 2 * c.expert_width, c.hidden_size),
        _first_half_t,
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.experts\.down_proj",
        "layers.expert_down",
        lambda c: (c.num_experts, c.hidden_size, c.expert_width),
        _experts_t,
    ),
]
# Architecture -> rules tried before the common ones, and the second outputs of some of them
# (keyed by the rule's pattern: only the fused tensor fills two params).
ARCH_RULES: dict[str, list[Rule]] = {"qwen3_moe": QWEN3_MOE_RULES, "minimax_m2": MINIMAX_M2_RULES}
_FUSED_GATE_UP = r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj"
ARCH_EXTRA: dict[str, dict[str, tuple[tuple[str, Transform], ...]]] = {
    arch: {_FUSED_GATE_UP: (("layers.expert_up", _second_half_t),)}
    for arch in ("qwen3_moe", "minimax_m2")
}
