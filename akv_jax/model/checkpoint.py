"""Converted checkpoints on disk: an orbax checkpoint of the params beside config.json.

Layout of a converted folder::

    config.json       hf_config.config_to_hf(cfg) plus an "akv_jax" entry (format, dtype, origin)
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

from akv_jax.model.config import ModelConfig
from akv_jax.model.hf_config import config_from_hf, config_to_hf
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
    hf = config_to_hf(cfg)
    hf["akv_jax"] = {"format": FORMAT_VERSION, "dtype": dtype, "origin": origin}
    (path / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, _nest(params_to_arrays(params)))
        ckptr.wait_until_finished()


def read_config(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """A converted folder's config (and its raw config.json)."""
    hf = json.loads((Path(path) / "config.json").read_text())
    return config_from_hf(hf), hf


def stores_packed(path: str | Path) -> bool:
    """Whether a converted folder holds packed MXFP4 expert weights (``*.blocks``)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        return any(k.endswith(".blocks") for k in _stored(ckptr, Path(path).absolute()))


def _stored(ckptr: Any, path: Path) -> dict[str, Any]:
    meta = ckptr.metadata(path / PARAMS_DIR)
    tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
    return _flatten(dict(tree))


def load_checkpoint(
    path: str | Path, dtype: Any = None, host: bool = False, mesh: Any = None
) -> tuple[ModelConfig, Params]:
    """Read a converted folder; ``dtype`` None keeps the stored dtype.

    Where the params go: by default onto JAX's default device; ``host=True``: numpy arrays
    as stored (``dtype`` not applied; the caller places them); ``mesh``: restored by orbax
    straight into their final shardings (:func:`akv_jax.model.params.leaf_shardings`), each
    device reading only its own shard, cast to ``dtype`` per shard as it is read.
    """
    import orbax.checkpoint as ocp

    from akv_jax.model.params import leaf_shardings, params_on_device

    path = Path(path).absolute()
    cfg, hf = read_config(path)
    stored = jnp.dtype(hf.get("akv_jax", {}).get("dtype", "float32"))
    dt = jnp.dtype(dtype) if dtype else stored
    with ocp.StandardCheckpointer() as ckptr:
        meta = _stored(ckptr, path)
    if mesh is not None:
        # zero-stride stand-ins (no memory) give the tree its packed/dense structure
        fake = {k: np.broadcast_to(np.zeros((), m.dtype), tuple(m.shape)) for k, m in meta.items()}
        shardings = params_to_arrays_tree(leaf_shardings(
            params_from_arrays(cfg, fake, host=True), cfg, mesh))
        # orbax restores into the shardings; a TPU row-major layout (a Format) is then set
        # per shard by device_put (the same sharding: nothing moves between devices)
        plain = {k: getattr(s, "sharding", s) for k, s in shardings.items()}
        target = {
            k: jax.ShapeDtypeStruct(
                tuple(m.shape), m.dtype if m.dtype == np.uint8 else dt, sharding=plain[k]
            )
            for k, m in meta.items()
        }
        with ocp.StandardCheckpointer() as ckptr:
            restored = _flatten(ckptr.restore(path / PARAMS_DIR, _nest(target)))
        restored = {
            k: x if shardings[k] is plain[k] else jax.device_put(x, shardings[k])
            for k, x in restored.items()
        }
        return cfg, params_from_arrays(cfg, restored, host=True)
    args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in meta}
    with ocp.PyTreeCheckpointer() as ckptr:
        restored = _flatten(ckptr.restore(path / PARAMS_DIR, restore_args=_nest(args)))
    params = params_from_arrays(cfg, restored, host=True)
    return cfg, params if host else params_on_device(params, dt)


def params_to_arrays_tree(tree: Any) -> dict[str, Any]:
    """Flat ``path -> leaf`` of any Params-shaped tree (``params_to_arrays`` without the
    numpy conversion)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {".".join(p.name for p in path): x for path, x in flat}
