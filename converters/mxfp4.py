"""MXFP4 expert weights as GPT-OSS releases them, to and from the dense layout.

Released layout (``quantization_config.quant_method == "mxfp4"``), per expert weight
``W`` of dense HF shape ``[E, in, out]``:

* ``<name>_blocks``: uint8 ``[E, out, in/32, 16]``, two 4-bit e2m1 codes per byte, the low
  nibble first (element ``2j`` of a 32-element block is byte ``j``'s low nibble);
* ``<name>_scales``: uint8 ``[E, out, in/32]``, a shared power of two per block, biased by 127.

``value = FP4_VALUES[code] * 2 ** (scale - 127)``. The dense layout transposes the last two
axes (``[E, in, out]``), as transformers' ``convert_moe_packed_tensors`` does.

:func:`quantize` exists for tests and tiny fixtures (a released checkpoint is already
quantised); it picks each block's scale so that its largest magnitude fits e2m1's range and
rounds every value to the nearest code.

:func:`select_out` lets the loader keep a released checkpoint's experts packed all the way to
the device (``--moe-weight-format mxfp4``), never building the dense weights: gpt-oss-120b's
~115B expert weights are ~61 GB packed but ~230 GB in bfloat16 (~460 GB in float32).
This module stays numpy-only: tests/make_golden.py loads it by path in a venv without akv_jax.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # values per scale
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
SCALE_BIAS = 127


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """``[E, out, in/32, 16]`` codes and ``[E, out, in/32]`` scales -> dense ``[E, in, out]``."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"mxfp4 blocks and scales must be uint8, got {blocks.dtype}, "
                         f"{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"mxfp4 blocks {blocks.shape} do not match scales {scales.shape} "
                         f"(expected blocks [..., {BLOCK // 2}] over the scales' shape)")
    *lead, groups, half = blocks.shape
    codes = np.empty((*lead, groups, 2 * half), np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    exp = scales.astype(np.int32) - SCALE_BIAS
    values = np.ldexp(FP4_VALUES[codes], exp[..., None])  # exact: a float32 times 2^k
    dense = values.reshape(*lead, groups * BLOCK)  # [E, out, in]
    return np.swapaxes(dense, -1, -2).astype(dtype)


def quantize(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense ``[E, in, out]`` (``in`` a multiple of 32) -> (blocks, scales), released layout."""
    w = np.swapaxes(np.asarray(dense, np.float32), -1, -2)  # [E, out, in]
    *lead, n_in = w.shape
    if n_in % BLOCK:
        raise ValueError(f"mxfp4 needs the input dimension to be a multiple of {BLOCK}, "
                         f"got {n_in}")
    w = w.reshape(*lead, n_in // BLOCK, BLOCK)
    peak = np.abs(w).max(axis=-1)
    # The smallest power of two that brings the block's peak within e2m1's largest value, 6.
    exp = np.where(peak > 0, np.ceil(np.log2(np.maximum(peak, 1e-30) / 6.0)), 0)
    exp = np.clip(exp, -SCALE_BIAS, 255 - SCALE_BIAS).astype(np.int32)
    scaled = w / np.ldexp(np.float32(1), exp)[..., None]
    # Nearest code (ties to the first, i.e. the smaller magnitude; -0.0 never chosen).
    codes = np.abs(np.abs(scaled)[..., None] - FP4_VALUES[:8]).argmin(axis=-1).astype(np.uint8)
    codes = np.where((scaled < 0) & (codes > 0), codes + 8, codes).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + SCALE_BIAS).astype(np.uint8)


def select_out(
    blocks: np.ndarray, scales: np.ndarray, columns: slice
) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of ``dense[..., columns]``: the dense layout's last (``out``) axis is
    the packed one's row axis, so this takes whole rows of codes and scales (no decoding)."""
    return (
        np.ascontiguousarray(blocks[..., columns, :, :]),
        np.ascontiguousarray(scales[..., columns, :]),
    )
