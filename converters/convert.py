"""Source -> akv_jax Params, validated up front, filled tensor by tensor with a progress bar."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from tqdm import tqdm

from akv_jax.model import checkpoint
from akv_jax.model.config import ModelConfig
from akv_jax.model.params import ArrayInfo, Params, params_from_arrays, stack_layers, stack_row
from akv_jax.pallas.grouped_matmul import Mxfp4Weight
from converters.mapping import PACKABLE, ConversionError, Target, hf_name_for, hf_target
from converters.sources import Source

NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def plan(source: Source) -> dict[str, Target]:
    """Check every tensor name and shape against the config, and that nothing is missing.

    Runs on header information only, so a bad checkpoint fails before any weight is read.
    Expert weights may come whole (``[E, ...]``) or one tensor per expert (Qwen3-MoE), never
    both for one layer.
    """
    cfg = source.config
    targets: dict[str, Target] = {}
    seen: set[tuple[str, int | None, int | None]] = set()
    for name, shape in source.shapes.items():
        tgt = hf_target(name, cfg)
        if tgt is None:
            continue
        if shape != tgt.hf_shape:
            raise ConversionError(
                f"shape mismatch for {name}: checkpoint has {shape}, config implies {tgt.hf_shape}"
            )
        targets[name] = tgt
        seen.update((path, tgt.layer, tgt.expert) for path, _ in tgt.outputs())
    for path, info in _abstract_paths(cfg).items():
        field = path.removeprefix("layers.")
        layers = stack_layers(cfg, field) if path.startswith("layers.") else [None]
        per_expert = info.axes[1:2] == ("expert",)
        for layer in layers:
            whole = (path, layer, None) in seen
            experts = [e for e in range(cfg.num_experts) if (path, layer, e) in seen] if (
                per_expert) else []
            if whole and experts:
                raise ConversionError(
                    f"checkpoint stores {hf_name_for(path, layer, cfg.arch)} both whole and per "
                    f"expert"
                )
            if whole or (per_expert and len(experts) == cfg.num_experts):
                continue
            if experts:  # some experts of this layer, not all
                e = next(e for e in range(cfg.num_experts) if e not in experts)
                name = hf_name_for(path, layer, cfg.arch, e)
            else:
                name = hf_name_for(path, layer, cfg.arch)
            raise ConversionError(f"checkpoint lacks tensor {name}")
    return targets


def _abstract_paths(cfg: ModelConfig) -> dict[str, ArrayInfo]:
    flat, _ = jax.tree_util.tree_flatten_with_path(
        Params.abstract(cfg), is_leaf=lambda x: isinstance(x, ArrayInfo)
    )
    return {".".join(p.name for p in path): info for path, info in flat}


def packable(source: Source, targets: dict[str, Target]) -> frozenset[str]:
    """The tensors of ``source`` stored as MXFP4 that can stay packed: those whose every
    param is an expert weight (:data:`converters.mapping.PACKABLE`)."""
    return frozenset(
        name for name in source.packed
        if name in targets and all(p in PACKABLE for p, _ in targets[name].outputs())
    )


def build_params(
    source: Source, dtype: str = "float32", progress: bool = True, keep_packed: bool = False,
    host: bool = False,
) -> Params:
    """Read, map and stack every tensor of ``source`` into a Params tree of ``dtype``.

    ``keep_packed``: the expert weights a released MXFP4 checkpoint stores packed stay packed
    (:class:`Mxfp4Weight`, the uint8 blocks and scales stacked over layers); no dense
    expert array is ever allocated for them. Everything else is dense as usual.
    ``host``: the numpy arrays, not device arrays (for the caller to place, e.g. sharded).
    """
    if dtype not in NP_DTYPES:
        raise ConversionError(f"unsupported dtype {dtype!r} (float32 or bfloat16)")
    targets = plan(source)
    cfg = source.config
    np_dtype = NP_DTYPES[dtype]
    packed = packable(source, targets) if keep_packed else frozenset()
    packed_paths = {p for name in packed for p, _ in targets[name].outputs()}
    arrays: dict[str, np.ndarray] = {}
    for p, info in _abstract_paths(cfg).items():
        if p in packed_paths:
            blocks, scales = Mxfp4Weight.packed_shapes(info.shape)
            arrays[f"{p}.blocks"] = np.empty(blocks, np.uint8)
            arrays[f"{p}.scales"] = np.empty(scales, np.uint8)
        else:
            arrays[p] = np.empty(info.shape, np_dtype)
    bar = tqdm(
        total=len(targets),
        desc=f"converting {Path(source.description).name}",
        unit="tensor",
        disable=not progress,
    )
    with bar:
        for name, w in source.read(keep_packed=packed):
            tgt = targets.get(name)
            if tgt is None:
                continue
            for path, transform in tgt.outputs():
                if isinstance(w, Mxfp4Weight):
                    out = transform(w, cfg)
                    _put(arrays[f"{path}.blocks"], cfg, path, tgt, out.blocks)
                    _put(arrays[f"{path}.scales"], cfg, path, tgt, out.scales)
                else:
                    _put(arrays[path], cfg, path, tgt, transform(np.asarray(w), cfg))
            bar.update(1)
    return params_from_arrays(cfg, arrays, dtype=np_dtype, host=host)


def _put(dst: np.ndarray, cfg: ModelConfig, path: str, tgt: Target, value: np.ndarray) -> None:
    # A whole tensor, one layer's row of its kind's stack (dense and MoE layers stack apart:
    # stack_row), or (per-expert checkpoints) one (row, expert) slice.
    if tgt.layer is None:
        dst[...] = value
        return
    row = stack_row(cfg, path.removeprefix("layers."), tgt.layer)
    if tgt.expert is None:
        dst[row] = value
    else:
        dst[row, tgt.expert] = value


def convert_to_checkpoint(
    source: Source,
    out: str | Path,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = True,
    keep_packed: bool = False,
) -> Path:
    """Convert ``source`` into a checkpoint folder at ``out`` (written atomically).

    ``keep_packed``: store a released MXFP4 checkpoint's expert weights packed, as they are
    (see :func:`build_params`); a source with no MXFP4 experts is refused rather than
    quantised, since conversion never changes a value.
    """
    out = Path(out).absolute()
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConversionError(f"output folder {out} exists and is not empty (use --force)")
    if keep_packed and not packable(source, plan(source)):
        raise ConversionError(
            f"--moe-weight-format mxfp4 keeps MXFP4 expert weights packed, and "
            f"{Path(source.description).name} has none (it stores them dense)"
        )
    params = build_params(source, dtype, progress, keep_packed)
    # Written beside ``out`` and renamed into place, so ``out`` is either complete or absent
    # (two processes converting the default model at once both succeed).
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    checkpoint.save_checkpoint(
        tmp, source.config, params, dtype=dtype, origin=str(source.description)
    )
    tok = source.tokenizer()
    for f in source.tokenizer_files:
        shutil.copy2(f, tmp / f.name)
    if tok is not None and not source.tokenizer_files:
        tok.save(tmp)
    if out.exists():
        shutil.rmtree(out)
    try:
        tmp.rename(out)
    except OSError:
        if not checkpoint.is_checkpoint(out):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    return out
