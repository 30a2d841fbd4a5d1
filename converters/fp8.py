"""Block-scaled FP8 weights as MiniMax-M2 and the Qwen3 FP8 releases ship them, dequantised.

Released layout (config.json's ``quantization_config``: ``quant_method: "fp8"``,
``fmt: "e4m3"``, ``weight_block_size: [bo, bi]``, ``activation_scheme: "dynamic"``,
``modules_to_not_convert`` (MiniMax's older spelling ``ignored_layers``)): every converted
Linear's ``<module>.weight`` is float8_e4m3fn ``[..., out, in]`` and ``<module>.weight_scale_inv``
float32 ``[..., ceil(out/bo), ceil(in/bi)]``, one scale per ``bo x bi`` block (the last row and
column of blocks may be partial)::

    dense[..., r, c] = float32(weight[..., r, c]) * scale_inv[..., r // bo, c // bi]

computed in float32 as transformers 5.24's ``finegrained_fp8`` does (``_dequantize_fp8_weight``
there; its ``Fp8Dequantize`` derives the block from the scale grid, the same thing whenever
the dimensions are multiples of the block, as in every release), then cast to the serving dtype
by the converter. Modules matching ``modules_to_not_convert`` are stored dense and read as they
are. Activations are not quantised: this is transformers' ``dequantize=True``.

This module stays numpy-only (with ml_dtypes for float8_e4m3fn).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import ml_dtypes
import numpy as np

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
SAFETENSORS_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"  # <module>.weight -> <module>.weight_scale_inv
FORMATS = ("e4m3", "float8_e4m3fn")  # config.json's ``fmt`` (absent means e4m3)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int]  # (rows, columns) of ``[out, in]`` per scale
    not_convert: tuple[str, ...]  # module patterns stored dense

    def converts(self, tensor: str) -> bool:
        """Whether ``tensor``'s module is FP8 by the config (transformers'
        ``should_convert_module``: a pattern matches from the start up to a module boundary,
        as a regex with that boundary, or as a suffix)."""
        module = tensor.rsplit(".", 1)[0]
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(
            re.match(rf"(?:{p}){boundary}", module) or module.endswith(p)
            for p in self.not_convert
        )


def parse_config(q: dict[str, Any], where: str) -> Fp8Config:
    """``quantization_config`` (``quant_method == "fp8"``) -> :class:`Fp8Config`, or a
    one-line ValueError naming the field."""
    fmt = q.get("fmt", "e4m3")
    if fmt not in FORMATS:
        raise ValueError(f"{where}: quantization_config.fmt {fmt!r} is not supported "
                         f"(only e4m3: {', '.join(FORMATS)})")
    scale_fmt = q.get("scale_fmt", "float")
    if scale_fmt != "float":
        raise ValueError(f"{where}: quantization_config.scale_fmt {scale_fmt!r} is not "
                         f"supported (only 'float': float32 weight_scale_inv)")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ValueError(f"{where}: quantization_config.activation_scheme {act!r} is not "
                         f"supported (only 'dynamic')")
    block = q.get("weight_block_size")
    if (
        not isinstance(block, list | tuple) or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"{where}: quantization_config.weight_block_size must be two "
                         f"positive integers, got {block!r}")
    skip = q.get("modules_to_not_convert")
    if skip is None:
        skip = q.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise ValueError(f"{where}: quantization_config.modules_to_not_convert must be a "
                         f"list of module names, got {skip!r}")
    for pattern in skip:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}: quantization_config.modules_to_not_convert entry "
                             f"{pattern!r} is not a valid pattern ({e})") from None
    return Fp8Config((block[0], block[1]), tuple(skip))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` ``[..., out, in]``."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def dequantize(
    weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "weight"
) -> np.ndarray:
    """float8_e4m3fn ``[..., out, in]`` and float32 ``[..., ceil(out/bo), ceil(in/bi)]``
    -> float32 ``[..., out, in]``, each value times its block's scale."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 tensor {name} must be float8_e4m3fn, not {weight.dtype}")
    if scale_inv.dtype != np.float32:
        raise ValueError(f"fp8 scale {name}{SCALE_SUFFIX} must be float32, not "
                         f"{scale_inv.dtype}")
    if weight.ndim < 2 or scale_inv.shape != scale_shape(weight.shape, block):
        raise ValueError(
            f"fp8 scale {name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, expected "
            f"{scale_shape(weight.shape, block) if weight.ndim >= 2 else '[..., out, in]'} "
            f"for weight {tuple(weight.shape)} in {block[0]}x{block[1]} blocks"
        )
    rows, cols = weight.shape[-2:]
    # Expanded over rows only ([..., out, ceil(in/bi)], a fraction of the weight), then
    # applied a column block at a time: no second weight-sized temporary.
    row_scales = np.repeat(scale_inv, block[0], axis=-2)[..., :rows, :]
    out = weight.astype(np.float32)
    for j in range(scale_inv.shape[-1]):
        out[..., j * block[1]:(j + 1) * block[1]] *= row_scales[..., j:j + 1]
    return out


def quantize(dense: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Dense ``[..., out, in]`` -> (float8_e4m3fn weight, float32 scale_inv), each block's
    scale its peak over 448 (for tests; a released checkpoint is already quantised)."""
    w = np.asarray(dense, np.float32)
    scales = np.ones(scale_shape(w.shape, block), np.float32)
    q = np.empty(w.shape, FP8_DTYPE)
    fmax = np.float32(ml_dtypes.finfo(FP8_DTYPE).max)
    for i in range(scales.shape[-2]):
        for j in range(scales.shape[-1]):
            rs = slice(i * block[0], (i + 1) * block[0])
            cs = slice(j * block[1], (j + 1) * block[1])
            tile = w[..., rs, cs]
            peak = np.abs(tile).max(axis=(-2, -1))
            s = np.where(peak > 0, peak / fmax, np.float32(1)).astype(np.float32)
            scales[..., i, j] = s
            q[..., rs, cs] = np.clip(tile / s[..., None, None], -fmax, fmax).astype(FP8_DTYPE)
    return q, scales
