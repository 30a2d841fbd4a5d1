"""Converted checkpoints on disk: an orbax checkpoint of the params beside config.json.

Layout of a converted folder::

    config.json       ModelConfig.to_hf_dict() plus an "akv_jax" entry (format, dtype, origin)
    params/           orbax StandardCheckpointer checkpoint of the params as a nested dict
    tokenizer.json, tokenizer_config.json, chat_template.jinja, ...   (when there is a tokenizer)

The params are stored as a nested dict of arrays (``{"layers": {"wq": ...}, "embed": ...}``)
rather than the dataclass tree, so the on-disk format does not depend on Python class names
and absent parameters (tied lm_head, no qk-norm) are simply absent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.model.config import ModelConfig, config_from_hf
from akv_jax.model.params import Params, params_from_arrays, params_to_arrays

PARAMS_DIR = "params"
FORMAT_VERSION = 1


def is_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return (p / PARAMS_DIR).is_dir() and (p / "config.json").is_file()


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, x in flat.items():
        node = out
        *parents, leaf = name.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = x
    return out


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def save_checkpoint(
    path: str | Path, cfg: ModelConfig, params: Params, dtype: str, origin: str = ""
) -> None:
    """Write config.json and the orbax params into the (existing, empty) folder ``path``."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    hf = cfg.to_hf_dict()
    hf["akv_jax"] = {"format": FORMAT_VERSION, "dtype": dtype, "origin": origin}
    (path / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, _nest(params_to_arrays(params)))
        ckptr.wait_until_finished()


def load_checkpoint(path: str | Path, dtype: Any = None) -> tuple[ModelConfig, Params]:
    """Read a converted folder; ``dtype`` None keeps the stored dtype."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    hf = json.loads((path / "config.json").read_text())
    cfg = config_from_hf(hf)
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path / PARAMS_DIR)
        tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), dict(tree))
        restored = ckptr.restore(path / PARAMS_DIR, target)
    flat = {k: np.asarray(v) for k, v in _flatten(restored).items()}
    stored = jnp.dtype(hf.get("akv_jax", {}).get("dtype", "float32"))
    return cfg, params_from_arrays(cfg, flat, dtype=jnp.dtype(dtype) if dtype else stored)
