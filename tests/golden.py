"""Access to the transformers golden fixtures written by tests/make_golden.py (never by hand)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GOLDEN = FIXTURES / "golden"
TINY = ("tiny_qwen3", "tiny_llama", "tiny_gpt_oss", "tiny_minimax_m2", "tiny_qwen3_moe")

# Tolerances, each justified by a measurement (see the tests that use them).
# float32 logits vs transformers: measured max |diff| 1.8e-6 (tiny_qwen3), 4.5e-6 (tiny_llama),
# 1.2e-6 (tiny_gpt_oss: MoE, sinks, sliding window, YaRN), 1.5e-6 (tiny_minimax_m2: sigmoid
# router, q/k norm over all heads, partial rotary), 1.8e-6 (tiny_qwen3_moe: softmax router, a
# dense layer and MoE layers, q/k norms; the same from its fused-experts copy),
# 8.2e-5 on SmolLM2-135M (30 layers, logits up to ~41: relative 2e-6, summation order only).
F32_ATOL = 1e-4


def tiny_dir(name: str) -> Path:
    return FIXTURES / name


@functools.cache
def tiny_golden(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


@functools.cache
def smollm2_meta() -> dict:
    return json.loads((GOLDEN / "smollm2.json").read_text())


@functools.cache
def smollm2_topk() -> dict[str, np.ndarray]:
    with np.load(GOLDEN / "smollm2.npz") as z:
        return {k: z[k] for k in z.files}


def topk_diff(name: str, logits: np.ndarray) -> float:
    """Max |ours - transformers| over the golden top-k entries of every position of a chat."""
    z = smollm2_topk()
    values, indices = z[f"{name}_topk_values"], z[f"{name}_topk_indices"]
    assert logits.shape[0] == values.shape[0]
    return float(np.abs(np.take_along_axis(logits, indices, axis=1) - values).max())
