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
from converters.mapping import ConversionError, Target, hf_name_for, hf_target
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


def build_params(source: Source, dtype: str = "float32", progress: bool = True) -> Params:
    """Read, map and stack every tensor of ``source`` into a Params tree of ``dtype``."""
    if dtype not in NP_DTYPES:
        raise ConversionError(f"unsupported dtype {dtype!r} (float32 or bfloat16)")
    targets = plan(source)
    cfg = source.config
    np_dtype = NP_DTYPES[dtype]
    arrays = {p: np.empty(info.shape, np_dtype) for p, info in _abstract_paths(cfg).items()}
    bar = tqdm(
        total=len(targets),
        desc=f"converting {Path(source.description).name}",
        unit="tensor",
        disable=not progress,
    )
    with bar:
        for name, w in source.read():
            tgt = targets.get(name)
            if tgt is None:
                continue
            for path, transform in tgt.outputs():
                out = transform(np.asarray(w), cfg)
                if tgt.layer is None:
                    arrays[path][...] = out
                elif tgt.expert is None:
                    arrays[path][stack_row(cfg, path.removeprefix("layers."), tgt.layer)] = out
                else:
                    row = stack_row(cfg, path.removeprefix("layers."), tgt.layer)
                    arrays[path][row, tgt.expert] = out
            bar.update(1)
    return params_from_arrays(cfg, arrays, dtype=np_dtype)


def convert_to_checkpoint(
    source: Source,
    out: str | Path,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert ``source`` into a checkpoint folder at ``out`` (written atomically)."""
    out = Path(out).absolute()
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConversionError(f"output folder {out} exists and is not empty (use --force)")
    params = build_params(source, dtype, progress)
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
