"""load_model's sources, the default model's cache, and the chat CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from golden import smollm2_meta, tiny_dir

from akv_jax.model import checkpoint
from akv_jax.model.presets import tiny_config
from converters.loading import (
    DEFAULT_MODEL,
    ModelLoadError,
    cache_root,
    default_gguf_path,
    default_model_dir,
    load_model,
)

REPO = Path(__file__).resolve().parent.parent


def test_tiny_is_seeded_and_has_a_chat_tokenizer():
    a, b = load_model("tiny"), load_model("tiny")
    assert a.cfg == tiny_config()
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.tokenizer is not None and a.tokenizer.vocab_size == a.cfg.vocab_size
    assert a.stop_ids == (a.cfg.vocab_size - 1,)
    assert load_model("tiny", "bfloat16").params.embed.dtype == np.dtype("bfloat16")


def test_hf_folder_without_tokenizer_loads_with_none():
    m = load_model(tiny_dir("tiny_qwen3"))
    assert m.tokenizer is None and m.cfg.arch == "qwen3" and m.cfg.tie_word_embeddings
    assert m.params.lm_head is None and m.params.layers.q_norm is not None


def test_bad_names_raise_model_load_error(tmp_path):
    for bad in (tmp_path / "missing", tmp_path):  # nothing there / an empty folder
        with pytest.raises(ModelLoadError):
            load_model(bad)
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="unknown architecture"):
        load_model(tmp_path)


def test_default_is_cached_once(default_model_cache):
    assert cache_root() == default_model_cache
    path = default_model_dir()
    assert path == default_model_cache / DEFAULT_MODEL and checkpoint.is_checkpoint(path)
    stamp = (path / "config.json").stat().st_mtime_ns
    m = load_model("default")
    assert (path / "config.json").stat().st_mtime_ns == stamp  # loaded, not reconverted
    assert m.cfg.num_layers == 30 and m.tokenizer is not None
    assert m.stop_ids == (smollm2_meta()["eos_token_id"],)


def test_gguf_file_in_memory_equals_converted(default_model_cache):
    direct = load_model(default_gguf_path())
    cached = load_model(None)
    assert direct.cfg == cached.cfg
    for x, y in zip(jax.tree.leaves(direct.params), jax.tree.leaves(cached.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    chat = smollm2_meta()["chats"][2]
    assert direct.tokenizer.apply_chat_template(chat["messages"], True) == chat["ids_gen"]


def test_chat_cli_names_paris(default_model_cache):
    env = dict(os.environ, AKV_JAX_CACHE=str(default_model_cache))
    r = subprocess.run(
        [sys.executable, "-m", "akv_jax.chat", "What is the capital of France?"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    # The answer is transformers' greedy continuation up to the end-of-turn token.
    rec = smollm2_meta()["chats"][0]
    golden = rec["continuation_text"].split("<|im_end|>")[0].strip()
    assert r.stdout.strip() == golden
