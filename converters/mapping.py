"""The one mapping from Hugging Face tensor names to akv_jax params (and the GGUF renames).

In the style of jax-ml/jax-llm-examples' converters: a table of ``regex -> (param path,
transform)`` with the layer index taken from the name. HF ``Linear`` weights are stored
``[out, in]``; akv_jax keeps ``[in, ...out]`` with heads as their own axis, so the transforms
are transposes and reshapes only (values are never changed). Expert weights a released MXFP4
checkpoint stores packed can also be mapped packed (:data:`PACKABLE`): their transforms
(identity; gate_up_proj's even / odd columns, which are whole rows of the packed layout)
never decode a value.

Qwen3-MoE and MiniMax-M2 checkpoints store one tensor per expert (Qwen3-MoE's
``mlp.experts.{e}.{gate,up,down}_proj.weight``, MiniMax-M2's
``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, as released and as transformers 5
``save_pretrained`` writes them); the rule's second group is the expert, and the converter
stacks the E tensors into the ``[E, ...]`` expert weights. transformers' in-memory fused layout
(``mlp.experts.gate_up_proj`` ``[E, 2F, D]`` with gate the first half, ``down_proj``
``[E, D, F]``) is accepted too. Those names clash with GPT-OSS's interleaved layout, so they
live in per-architecture rules consulted first (:data:`_ARCH_RULES`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import numpy as np

from akv_jax.model.config import ModelConfig
from akv_jax.model.params import PACKABLE_FIELDS, ArrayInfo, Params, stack_row
from akv_jax.pallas.grouped_matmul import Mxfp4Weight
from converters import mxfp4

# Takes and returns numpy arrays; the transforms of expert weights (identity, even / odd
# columns) also take a packed Mxfp4Weight, which the loader may keep packed.
Transform = Callable[[np.ndarray, ModelConfig], np.ndarray]


class ConversionError(ValueError):
    """A checkpoint that cannot be converted (missing/unexpected tensor, wrong shape...)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: param ``path``, ``layer`` index (None if not stacked)."""

    path: str
    layer: int | None
    hf_shape: tuple[int, ...]
    transform: Transform
    # Further params filled from the same tensor (GPT-OSS's interleaved gate_up_proj fills
    # both the expert gate and up weights): (path, transform) pairs.
    extra: tuple[tuple[str, Transform], ...] = ()
    # The expert this tensor holds (per-expert checkpoints: Qwen3-MoE, MiniMax-M2): it fills
    # ``[layer, expert]`` of the stacked param; None for whole tensors.
    expert: int | None = None

    def outputs(self) -> tuple[tuple[str, Transform], ...]:
        return ((self.path, self.transform), *self.extra)


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

# HF name (regex; group 1 is the layer) -> (akv_jax path, HF shape from the config, transform).
_RULES: list[tuple[str, str, Callable[[ModelConfig], tuple[int, ...]], Transform]] = [
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
_COMPILED = [(re.compile(pat), path, shape, fn) for pat, path, shape, fn in _RULES]


def _norm_heads(n_heads: Callable[[ModelConfig], int]) -> Transform:
    # MiniMax-M2's q/k norm weight over the whole projection: [H*Dh] -> [H, Dh]
    return lambda w, cfg: w.reshape(n_heads(cfg), cfg.head_dim)


# Params that may be filled from a packed MXFP4 tensor and stay packed (Mxfp4Weight).
PACKABLE = frozenset(f"layers.{f}" for f in PACKABLE_FIELDS)
# The odd half of an interleaved tensor: param path -> (path it rides with, transform).
_EXTRA = {
    "layers.expert_gate": (("layers.expert_up", _odd),),
    "layers.expert_gate_bias": (("layers.expert_up_bias", _odd),),
}


def _experts_t(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(w, -1, -2))  # [E, out, in] -> [E, in, out]


def _first_half_t(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return _experts_t(w[:, : cfg.expert_width], cfg)  # fused gate_up_proj: gate first


def _second_half_t(w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return _experts_t(w[:, cfg.expert_width :], cfg)


_QWEN3_MOE_RULES: list[tuple[str, str, Callable[[ModelConfig], tuple[int, ...]], Transform]] = [
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
_MINIMAX_M2_RULES: list[tuple[str, str, Callable[[ModelConfig], tuple[int, ...]], Transform]] = [
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
_ARCH_RULES = {"qwen3_moe": _QWEN3_MOE_RULES, "minimax_m2": _MINIMAX_M2_RULES}
_FUSED_GATE_UP = r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj"
_ARCH_EXTRA = {
    arch: {_FUSED_GATE_UP: (("layers.expert_up", _second_half_t),)}
    for arch in ("qwen3_moe", "minimax_m2")
}
_ARCH_COMPILED = {
    arch: [(re.compile(pat), path, shape, fn) for pat, path, shape, fn in rules]
    for arch, rules in _ARCH_RULES.items()
}


@functools.cache
def _param_paths(cfg: ModelConfig) -> frozenset[str]:
    """The param paths ``cfg``'s model has (optional fields are None otherwise)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        Params.abstract(cfg), is_leaf=lambda x: isinstance(x, ArrayInfo)
    )
    return frozenset(".".join(p.name for p in path) for path, _ in flat)

# Present in some checkpoints, never needed: RoPE buffers are recomputed from the config.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_target(name: str, cfg: ModelConfig) -> Target | None:
    """Where HF tensor ``name`` goes, or None if it is to be skipped.

    Raises :class:`ConversionError` for a tensor akv_jax has no place for (e.g. biases, or an
    architecture feature it does not implement), so nothing is silently dropped.
    """
    if _IGNORED.fullmatch(name):
        return None
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None  # some tied checkpoints store the (identical) head anyway
    arch_rules = _ARCH_COMPILED.get(cfg.arch, [])
    for i, (pat, path, shape, fn) in enumerate([*arch_rules, *_COMPILED]):
        m = pat.fullmatch(name)
        if m is None:
            continue
        if path not in _param_paths(cfg):
            break  # e.g. a qk-norm in a Llama, a bias in a model without biases
        layer = int(m.group(1)) if m.groups() else None
        if layer is not None and not 0 <= layer < cfg.num_layers:
            raise ConversionError(
                f"tensor {name}: layer {layer} >= num_hidden_layers {cfg.num_layers}"
            )
        if layer is not None and stack_row(cfg, path.removeprefix("layers."), layer) is None:
            kind = "an MoE" if cfg.is_moe_layer(layer) else "a dense"
            raise ConversionError(
                f"unexpected tensor {name}: layer {layer} has {kind} MLP in this config "
                f"(mlp_only_layers / decoder_sparse_step)"
            )
        expert = int(m.group(2)) if len(m.groups()) > 1 else None
        if expert is not None and not 0 <= expert < cfg.num_experts:
            raise ConversionError(
                f"tensor {name}: expert {expert} >= {_experts_field(cfg)} {cfg.num_experts}"
            )
        if i < len(arch_rules):
            extra = _ARCH_EXTRA.get(cfg.arch, {}).get(pat.pattern, ())
        else:
            extra = _EXTRA.get(path, ())
        return Target(path, layer, shape(cfg), fn, extra, expert)
    raise ConversionError(f"unexpected tensor {name} (not part of a supported {cfg.arch} model)")


def _experts_field(cfg: ModelConfig) -> str:
    # The expert count's name in the architecture's own config.json, for error messages.
    return "num_experts" if cfg.arch == "qwen3_moe" else "num_local_experts"


def hf_name_for(
    path: str, layer: int | None, arch: str | None = None, expert: int | None = None
) -> str:
    """The HF tensor name that fills param ``path`` (at ``layer``, and ``expert`` for a
    per-expert checkpoint of ``arch``): for error messages."""
    if expert is not None:
        rules = [r for r in _ARCH_RULES.get(arch, []) if r[0].count(r"(\d+)") == 2]
    else:
        rules = [r for r in _ARCH_RULES.get(arch, []) if r[0].count(r"(\d+)") < 2] + _RULES
    for base, extra in _EXTRA.items():
        if any(path == p for p, _ in extra) and not any(p == path for _, p, _, _ in rules):
            path = base
    for pat, p, _, _ in rules:
        if p == path:
            name = pat
            for idx in (layer, expert):
                if idx is not None:
                    name = name.replace(r"(\d+)", str(idx), 1)
            return name.replace("\\.", ".")
    return path


# GGUF (llama.cpp) tensor names -> HF names. Llama q/k weights are also row-permuted by
# llama.cpp's converter; :func:`unpermute_llama_qk` undoes that.
_GGUF_RENAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]
_GGUF_COMPILED = [(re.compile(p), r) for p, r in _GGUF_RENAMES]


def gguf_to_hf_name(name: str) -> str:
    for pat, repl in _GGUF_COMPILED:
        if pat.fullmatch(name):
            return pat.sub(repl, name)
    raise ConversionError(f"unexpected GGUF tensor {name}")


def unpermute_llama_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers' ``_reverse_permute_weights``).

    llama.cpp interleaves the two rotary halves of each head for its RoPE kernel; HF keeps
    them split. ``n_head`` is the number of heads of *this* projection (kv heads for k).
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
