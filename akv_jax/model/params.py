"""The params pytree, declared once: every array's shape, dtype and logical axes.

Layers are stacked on a leading ``layer`` axis so the forward pass is a ``lax.scan``
(one compiled layer body, fast compiles on the CPU). Logical axes map to mesh axes through
:data:`SHARDING_RULES`; tensor parallelism splits attention heads and the FFN width (of the
dense MLP and of every expert). Fields a model does not have (Qwen3's qk-norms for Llama,
GPT-OSS's biases, sinks and experts for the others) are None.

A model may mix dense-MLP and MoE layers (Qwen3-MoE's ``mlp_only_layers`` /
``decoder_sparse_step``): the dense MLP weights are then stacked over the dense layers only and
the router and expert weights over the MoE layers only (:func:`stack_layers`), so no layer
carries weights it does not use. For a model whose layers are all of one kind both stacks are
over every layer, as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from akv_jax.model.config import ModelConfig
from akv_jax.pallas.grouped_matmul import Mxfp4Weight


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """Declaration of one parameter array (a leaf of the abstract params tree)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"  # "normal" (std 0.02) or "ones"


def is_array_info(x: Any) -> bool:
    """Whether ``x`` is an :class:`ArrayInfo` leaf (``is_leaf`` for trees of them)."""
    return isinstance(x, ArrayInfo)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Decoder layer weights, each with a leading ``layer`` axis."""

    attn_norm: Any  # [L, D]
    wq: Any  # [L, D, Hq, Dh]
    wk: Any  # [L, D, Hkv, Dh]
    wv: Any  # [L, D, Hkv, Dh]
    wo: Any  # [L, Hq, Dh, D]
    q_norm: Any  # [L, Dh] (Qwen3), [L, Hq, Dh] (MiniMax-M2: over all heads) or None
    k_norm: Any  # [L, Dh] (Qwen3), [L, Hkv, Dh] (MiniMax-M2) or None
    mlp_norm: Any  # [L, D]
    w_gate: Any  # [L, D, F] (dense MLP) or None (MoE)
    w_up: Any  # [L, D, F] or None
    w_down: Any  # [L, F, D] or None
    # GPT-OSS only (None otherwise): attention biases and per-head sinks ...
    bq: Any = None  # [L, Hq, Dh]
    bk: Any = None  # [L, Hkv, Dh]
    bv: Any = None  # [L, Hkv, Dh]
    bo: Any = None  # [L, D]
    sinks: Any = None  # [L, Hq]
    # ... and the mixture of experts (E experts, expert width F).
    router: Any = None  # [L, D, E]
    router_bias: Any = None  # [L, E]
    # The three expert weights are arrays, or Mxfp4Weight (packed, --moe-weight-format mxfp4).
    # Their leading axis (and the router's, and the dense w_gate/w_up/w_down's) runs over the
    # layers of their kind only (:func:`stack_layers`).
    expert_gate: Any = None  # [L, E, D, F]
    expert_up: Any = None  # [L, E, D, F]
    expert_gate_bias: Any = None  # [L, E, F]
    expert_up_bias: Any = None  # [L, E, F]
    expert_down: Any = None  # [L, E, F, D]
    expert_down_bias: Any = None  # [L, E, D]
    # MiniMax-M2's router: ``e_score_correction_bias``, added to the sigmoid scores to choose
    # the top-k only (GPT-OSS's ``router_bias`` is a logit bias).
    router_score_bias: Any = None  # [L, E]


# The LayerParams fields that may be a packed Mxfp4Weight instead of an array.
PACKABLE_FIELDS = ("expert_gate", "expert_up", "expert_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    embed: Any  # [V, D]
    layers: LayerParams
    final_norm: Any  # [D]
    lm_head: Any  # [D, V], or None when the embeddings are tied

    @staticmethod
    def abstract(cfg: ModelConfig) -> Params:
        """The params tree with :class:`ArrayInfo` leaves."""
        L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        Hq, Hkv, Dh, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
        qk_norm = ArrayInfo((L, Dh), ("layer", "head_dim"), "ones") if cfg.qk_norm else None
        q_norm = k_norm = qk_norm
        if cfg.qk_norm_over_heads:  # one weight per (head, dim): the norm spans all heads
            q_norm = ArrayInfo((L, Hq, Dh), ("layer", "q_heads", "head_dim"), "ones")
            k_norm = ArrayInfo((L, Hkv, Dh), ("layer", "kv_heads", "head_dim"), "ones")
        Ld = len(cfg.mlp_layers(moe=False))
        dense = Ld > 0
        layers = LayerParams(
            attn_norm=ArrayInfo((L, D), ("layer", "embed"), "ones"),
            wq=ArrayInfo((L, D, Hq, Dh), ("layer", "embed", "q_heads", "head_dim")),
            wk=ArrayInfo((L, D, Hkv, Dh), ("layer", "embed", "kv_heads", "head_dim")),
            wv=ArrayInfo((L, D, Hkv, Dh), ("layer", "embed", "kv_heads", "head_dim")),
            wo=ArrayInfo((L, Hq, Dh, D), ("layer", "q_heads", "head_dim", "embed")),
            q_norm=q_norm,
            k_norm=k_norm,
            mlp_norm=ArrayInfo((L, D), ("layer", "embed"), "ones"),
            w_gate=ArrayInfo((Ld, D, F), ("layer", "embed", "ffw")) if dense else None,
            w_up=ArrayInfo((Ld, D, F), ("layer", "embed", "ffw")) if dense else None,
            w_down=ArrayInfo((Ld, F, D), ("layer", "ffw", "embed")) if dense else None,
            **_attention_extras(cfg),
            **_moe_params(cfg),
        )
        return Params(
            embed=ArrayInfo((V, D), ("vocab", "embed")),
            layers=layers,
            final_norm=ArrayInfo((D,), ("embed",), "ones"),
            lm_head=None if cfg.tie_word_embeddings else ArrayInfo((D, V), ("embed", "vocab")),
        )


def _attention_extras(cfg: ModelConfig) -> dict[str, ArrayInfo]:
    L, D, Hq, Hkv, Dh = (
        cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    )
    out = {}
    if cfg.attention_bias:
        out.update(
            bq=ArrayInfo((L, Hq, Dh), ("layer", "q_heads", "head_dim")),
            bk=ArrayInfo((L, Hkv, Dh), ("layer", "kv_heads", "head_dim")),
            bv=ArrayInfo((L, Hkv, Dh), ("layer", "kv_heads", "head_dim")),
            bo=ArrayInfo((L, D), ("layer", "embed")),
        )
    if cfg.attention_sinks:
        out["sinks"] = ArrayInfo((L, Hq), ("layer", "q_heads"))
    return out


def _moe_params(cfg: ModelConfig) -> dict[str, ArrayInfo]:
    L = len(cfg.mlp_layers(moe=True))
    if L == 0:
        return {}
    D, F, E = cfg.hidden_size, cfg.expert_width, cfg.num_experts
    out = dict(
        router=ArrayInfo((L, D, E), ("layer", "embed", "expert")),
        expert_gate=ArrayInfo((L, E, D, F), ("layer", "expert", "embed", "ffw")),
        expert_up=ArrayInfo((L, E, D, F), ("layer", "expert", "embed", "ffw")),
        expert_down=ArrayInfo((L, E, F, D), ("layer", "expert", "ffw", "embed")),
    )
    if cfg.sigmoid_router:  # MiniMax-M2: no biases but the router's score correction
        out.update(router_score_bias=ArrayInfo((L, E), ("layer", "expert")))
    if cfg.moe_bias:
        out.update(
            router_bias=ArrayInfo((L, E), ("layer", "expert")),
            expert_gate_bias=ArrayInfo((L, E, F), ("layer", "expert", "ffw")),
            expert_up_bias=ArrayInfo((L, E, F), ("layer", "expert", "ffw")),
            expert_down_bias=ArrayInfo((L, E, D), ("layer", "expert", "embed")),
        )
    return out


DENSE_MLP_FIELDS = ("w_gate", "w_up", "w_down")
MOE_FIELDS = (
    "router", "router_bias", "router_score_bias", "expert_gate", "expert_up",
    "expert_gate_bias", "expert_up_bias", "expert_down", "expert_down_bias",
)


def stack_layers(cfg: ModelConfig, field: str) -> tuple[int, ...]:
    """The layers whose weights LayerParams ``field`` stacks, in row order: the dense layers
    for the dense MLP fields, the MoE layers for the router and experts, every layer else."""
    if field in DENSE_MLP_FIELDS:
        return cfg.mlp_layers(moe=False)
    if field in MOE_FIELDS:
        return cfg.mlp_layers(moe=True)
    return tuple(range(cfg.num_layers))


def stack_row(cfg: ModelConfig, field: str, layer: int) -> int | None:
    """The row of layer ``layer`` in LayerParams ``field`` (None: that layer has no such
    weight, e.g. an expert in a dense-MLP layer)."""
    rows = stack_layers(cfg, field)
    return rows.index(layer) if layer in rows else None


# Logical axis -> mesh axis. Heads and FFN width split over "tensor"; everything else is
# replicated. A dimension that the mesh axis does not divide stays replicated (see
# :func:`logical_to_spec`), so any model runs on any mesh, just with less parallelism.
SHARDING_RULES: dict[str, str | None] = {
    "layer": None,
    "embed": None,
    "vocab": None,
    "head_dim": None,
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "ffw": "tensor",
    # Experts are tensor-parallel *inside* each expert (their width is "ffw", split like the
    # dense MLP), not expert-parallel: every device holds a slice of every expert, so the
    # token sort and the ragged_dot groups are the same on every device and the only
    # collective is the down projection's all-reduce, as for the dense MLP. Expert
    # parallelism would need an all-to-all token dispatch that GSPMD does not derive.
    "expert": None,
}


def logical_to_spec(
    axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh | None, rules=SHARDING_RULES
) -> PartitionSpec:
    out = []
    for name, dim in zip(axes, shape, strict=True):
        mesh_axis = rules.get(name)
        if mesh is None or mesh_axis is None or mesh_axis not in mesh.shape:
            out.append(None)
        elif dim % mesh.shape[mesh_axis] == 0:
            out.append(mesh_axis)
        else:
            out.append(None)
    return PartitionSpec(*out)


def row_major_on_tpu(info: ArrayInfo) -> bool:
    """Whether a parameter is stored row-major on a TPU: the stacked expert weights
    ``[L, E, in, out]``. XLA:TPU's default layout puts the expert axis minor-most, so the
    step copied every layer's experts into the row-major form ``ragged_dot`` wants; stored
    row-major, the layer scan slices them without a copy (docs/hardware.md, "Open")."""
    return len(info.axes) == 4 and info.axes[:2] == ("layer", "expert")


def param_placement(info: ArrayInfo, sharding: Any, platform: str | None) -> Any:
    """``sharding``, or on a TPU for a :func:`row_major_on_tpu` weight a ``Format`` that also
    fixes its layout row-major (what ``jax.device_put`` and ``.lower()`` take alike)."""
    if platform == "tpu" and row_major_on_tpu(info):
        return Format(Layout(major_to_minor=tuple(range(len(info.shape)))), sharding)
    return sharding


def mesh_platform(mesh: Mesh) -> str:
    return mesh.devices.flat[0].platform


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> Params:
    """NamedShardings for every parameter under ``mesh`` (on a TPU, the stacked expert
    weights' come with a row-major layout: :func:`row_major_on_tpu`)."""
    platform = mesh_platform(mesh)

    def one(info: ArrayInfo):
        sh = NamedSharding(mesh, logical_to_spec(info.axes, info.shape, mesh))
        return param_placement(info, sh, platform)

    return jax.tree.map(one, Params.abstract(cfg), is_leaf=is_array_info)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random params (the tiny test model): normal(0.02) weights, unit norms."""
    abstract = Params.abstract(cfg)
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=is_array_info)
    keys = jax.random.split(key, len(leaves))
    out = []
    for info, k in zip(leaves, keys, strict=True):
        if info.init == "ones":
            # Norm weights near one but not exactly, so a missed norm shows in tests.
            arr = 1.0 + 0.1 * jax.random.normal(k, info.shape, jnp.float32)
        else:
            arr = 0.02 * jax.random.normal(k, info.shape, jnp.float32)
        out.append(arr.astype(dtype))
    return jax.tree.unflatten(treedef, out)


def seeded_params(cfg: ModelConfig, seed: int, dtype=jnp.float32, host: bool = False) -> Params:
    """Random params like :func:`init_params`, drawn with numpy from an integer seed.

    Same distributions, but no per-shape XLA compiles (eager ``jax.random`` compiles one
    program per distinct shape, most of a tiny model's start-up): this is what the
    ``tiny`` model that servers and tests start from uses. ``host``: float32 numpy arrays
    (``dtype`` not applied), to be placed later (:func:`shard_params`, :func:`params_on_device`).
    """
    rng = np.random.default_rng(seed)
    abstract = Params.abstract(cfg)
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=is_array_info)
    out = []
    for info in leaves:
        z = rng.standard_normal(info.shape, dtype=np.float32)
        arr = 1.0 + 0.1 * z if info.init == "ones" else 0.02 * z
        out.append(arr if host else jnp.asarray(arr, dtype=dtype))
    return jax.tree.unflatten(treedef, out)


def params_from_arrays(
    cfg: ModelConfig, arrays: dict[str, np.ndarray], dtype=jnp.float32, host: bool = False
) -> Params:
    """Assemble a Params tree from flat ``path -> array`` entries, checking every shape.

    Paths are the dataclass field names joined with '.', e.g. ``layers.wq``. A packed expert
    weight (:data:`PACKABLE_FIELDS`) comes as ``<path>.blocks`` and ``<path>.scales`` uint8
    entries (as :func:`params_to_arrays` names them) and becomes an :class:`Mxfp4Weight`;
    ``dtype`` applies to the float arrays only. ``host``: the numpy arrays themselves (no
    copy, ``dtype`` not applied), to be placed later (:func:`shard_params`,
    :func:`params_on_device`).
    """
    abstract = Params.abstract(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_array_info)
    out = []
    for path, info in flat:
        name = ".".join(p.name for p in path)
        if f"{name}.blocks" in arrays or f"{name}.scales" in arrays:
            out.append(_packed_from_arrays(name, info, arrays, host))
            continue
        if name not in arrays:
            raise ValueError(f"missing parameter {name}")
        arr = _host_or_device(arrays[name])
        if tuple(arr.shape) != info.shape:
            raise ValueError(f"shape mismatch for {name}: got {arr.shape}, expected {info.shape}")
        out.append(arr if host else jnp.asarray(arr, dtype=dtype))
    return jax.tree.unflatten(treedef, out)


def _host_or_device(x: Any) -> Any:
    # device arrays (placed by the caller) stay where they are; anything else is numpy
    return x if isinstance(x, jax.Array) else np.asarray(x)


def _packed_from_arrays(
    name: str, info: ArrayInfo, arrays: dict[str, np.ndarray], host: bool = False
) -> Mxfp4Weight:
    if name.removeprefix("layers.") not in PACKABLE_FIELDS:
        raise ValueError(f"parameter {name} cannot be stored packed (only the expert weights)")
    want = Mxfp4Weight.packed_shapes(info.shape)
    parts = []
    for part, shape in zip(("blocks", "scales"), want, strict=True):
        key = f"{name}.{part}"
        if key not in arrays:
            raise ValueError(f"missing parameter {key}")
        arr = _host_or_device(arrays[key])
        if arr.dtype != np.uint8:
            raise ValueError(f"packed parameter {key} must be uint8, got {arr.dtype}")
        if tuple(arr.shape) != shape:
            raise ValueError(f"shape mismatch for {key}: got {arr.shape}, expected {shape}")
        parts.append(arr if host else jnp.asarray(arr))
    return Mxfp4Weight(*parts)


def params_to_arrays(params: Params) -> dict[str, np.ndarray]:
    """Flat ``path -> array``; a packed weight gives ``<path>.blocks`` and ``<path>.scales``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {".".join(p.name for p in path): np.asarray(x) for path, x in flat}


def cast_params(params: Params, dtype) -> Params:
    """Every float array as ``dtype`` (packed MXFP4 experts stay packed)."""
    return jax.tree.map(lambda x: x if x.dtype == jnp.uint8 else x.astype(dtype), params)


def leaf_shardings(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """A placement for every leaf of ``params`` (a concrete tree: arrays, host numpy
    arrays, ShapeDtypeStructs or :class:`Mxfp4Weight` of those) under ``mesh``: dense arrays
    by :func:`param_shardings` (on a TPU the stacked dense expert weights as a row-major
    ``Format``: :func:`row_major_on_tpu`); a packed MXFP4 expert weight split like its dense
    form (its ``out`` and ``in/32`` axes carry the dense ``out`` and ``in`` axes' names; the
    16-byte block axis is never split)."""

    def one(info: ArrayInfo, x: Any) -> Any:
        if isinstance(x, Mxfp4Weight):
            *lead, ax_in, ax_out = info.axes
            b_axes = (*lead, ax_out, ax_in, "mxfp4_block")
            return Mxfp4Weight(
                NamedSharding(mesh, logical_to_spec(b_axes, x.blocks.shape, mesh)),
                NamedSharding(mesh, logical_to_spec(b_axes[:-1], x.scales.shape, mesh)),
            )
        sh = NamedSharding(mesh, logical_to_spec(info.axes, info.shape, mesh))
        return param_placement(info, sh, platform)

    platform = mesh_platform(mesh)
    return jax.tree.map(one, Params.abstract(cfg), params, is_leaf=is_array_info)


def place_array(x: Any, sharding: Any, dtype=None) -> jax.Array:
    """``x`` with ``sharding`` (a Sharding, or a ``Format``: sharding and layout). A host
    (numpy) array goes straight to its final placement: each device receives only its own
    shard, sliced (and cast to ``dtype``) on the host by ``jax.make_array_from_callback``;
    the whole array never lands on one device (unless the sharding replicates it). A device
    array is resharded with ``jax.device_put`` (a no-op when it is already placed so)."""
    if isinstance(x, jax.Array):
        if dtype is not None and x.dtype != dtype:
            x = x.astype(dtype)
        have = x.format if isinstance(sharding, Format) else x.sharding
        return x if have == sharding else jax.device_put(x, sharding)
    host = np.asarray(x)
    dt = host.dtype if dtype is None else np.dtype(dtype)
    shards: dict[tuple, np.ndarray] = {}  # one host slice per distinct index (replicas share)

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in shards:
            shards[key] = np.ascontiguousarray(host[index], dtype=dt)
        return shards[key]

    return jax.make_array_from_callback(host.shape, sharding, shard)


def _float_dtype(x: Any, dtype) -> Any:
    return None if dtype is None or x.dtype == np.uint8 else dtype


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh, dtype=None) -> Params:
    """``params`` placed by :func:`leaf_shardings` (see :func:`place_array`: host arrays go
    to each device shard by shard; device arrays are resharded). ``dtype``: the float
    arrays' serving dtype, cast on the host per shard (packed uint8 experts stay uint8)."""
    shardings = leaf_shardings(params, cfg, mesh)
    return jax.tree.map(
        lambda x, s: place_array(x, s, _float_dtype(x, dtype)), params, shardings
    )


def params_on_device(params: Params, dtype=None, device=None) -> Params:
    """Host params as arrays on ``device`` (default: JAX's default device), float arrays cast
    to ``dtype`` on the host."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            dt = _float_dtype(x, dtype)
            x = x if dt is None or x.dtype == dt else x.astype(dt)
            return x if device is None else jax.device_put(x, device)
        dt = _float_dtype(np.asarray(x), dtype)
        host = np.asarray(x) if dt is None else np.asarray(x, dtype=dt)
        return jax.device_put(host, device)

    return jax.tree.map(one, params)


def make_mesh(tp: int, devices=None) -> Mesh:
    """A ("data", "tensor") mesh with ``tp`` devices on the tensor axis."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or len(devices) % tp:
        raise ValueError(f"--tp {tp} does not divide the {len(devices)} available devices")
    arr = np.array(devices).reshape(len(devices) // tp, tp)
    return Mesh(arr, ("data", "tensor"))
