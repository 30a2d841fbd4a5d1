"""Configs that no config.json gives: the random test models and the released models' shapes.

The tiny configs (:func:`tiny_config` and its kin) are the random models behind
``--model-path tiny`` and ``tiny-*``, small enough for the CPU and with every dimension
distinct; :data:`PRESETS` are released models' shapes (their Hugging Face config.json,
abridged) for shape-only work: deviceless compiles, memory plans and benchmarks with random
weights. Serving a real checkpoint reads its own config.json instead
(:mod:`akv_jax.model.hf_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from akv_jax.model.config import ConfigError, ModelConfig, RopeConfig


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


# The released models' shapes (see the module docstring).
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


PRESETS: dict[str, Callable[[], ModelConfig]] = {
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
