"""GGUF (llama.cpp) tensor names as Hugging Face names, and llama.cpp's q/k permutation undone.

A GGUF file is converted by renaming its tensors to the Hugging Face names
(:func:`gguf_to_hf_name`) and then mapping them like a safetensors checkpoint's
(:mod:`converters.mapping`). Llama q/k weights are also row-permuted by llama.cpp's
converter; :func:`unpermute_llama_qk` undoes that.
"""

from __future__ import annotations

import re

import numpy as np

from converters.mapping import ConversionError

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
    """The Hugging Face name of GGUF tensor ``name``."""
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
