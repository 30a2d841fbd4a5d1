"""converters.hf_to_jax: round trips against the transformers fixtures, and its error contract."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from golden import F32_ATOL, TINY, smollm2_meta, tiny_dir, tiny_golden, topk_diff

from akv_jax.model import checkpoint
from akv_jax.model.causal import greedy_generate
from converters.hf_to_jax import main as convert_main
from converters.loading import default_model_dir, load_model

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", TINY)
def test_hf_to_orbax_round_trip_parity(name, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert convert_main(["--hf-dir", str(tiny_dir(name)), "--out", str(out), "--quiet"]) == 0
    assert checkpoint.is_checkpoint(out)
    assert "error" not in capsys.readouterr().err
    m = load_model(out, "float32")
    g = tiny_golden(name)
    logits, cont = greedy_generate(m.params, m.cfg, g["prompt"].tolist(), 16)
    assert np.abs(logits - g["logits"]).max() <= F32_ATOL
    assert cont == g["continuation"].tolist()
    # The converted config reads back to the same model config as the source's.
    assert m.cfg == load_model(tiny_dir(name)).cfg


def test_bfloat16_conversion_stores_rounded_float32(tmp_path):
    out = tmp_path / "bf16"
    args = ["--hf-dir", str(tiny_dir("tiny_llama")), "--out", str(out), "--dtype", "bfloat16"]
    assert convert_main([*args, "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["akv_jax"]["dtype"] == "bfloat16"
    _, stored = checkpoint.load_checkpoint(out)  # dtype None: as stored
    ref = load_model(tiny_dir("tiny_llama"), "float32").params
    assert stored.layers.wq.dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(
        np.asarray(stored.layers.wq), np.asarray(ref.layers.wq).astype("bfloat16")
    )


def test_gguf_to_orbax_default_model(default_model_cache):
    """The default model's cache folder is a converted checkpoint with its tokenizer, and
    loading it reproduces transformers on one chat (the other chats: test_model_parity)."""
    path = default_model_dir()
    assert path.parent == default_model_cache
    assert checkpoint.is_checkpoint(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (path / f).is_file()
    m = load_model(path, "float32")
    rec = smollm2_meta()["chats"][1]
    logits, cont = greedy_generate(m.params, m.cfg, rec["ids_gen"], 16)
    assert topk_diff(rec["name"], logits) <= F32_ATOL
    assert cont == rec["continuation"]
    assert m.tokenizer is not None
    assert m.tokenizer.apply_chat_template(rec["messages"], True) == rec["ids_gen"]


# ----------------------------------------------------------------------------- CLI errors


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "converters.hf_to_jax", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _copy_fixture(name: str, dst: Path) -> Path:
    shutil.copytree(tiny_dir(name), dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _broken_checkpoints(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (CLI source args, a phrase the error line must contain)."""
    cases: dict[str, tuple[list[str], str]] = {}
    cases["missing_dir"] = (["--hf-dir", str(tmp / "nope")], "does not exist")
    empty = tmp / "empty"
    empty.mkdir()
    cases["missing_config"] = (["--hf-dir", str(empty)], "config.json")
    arch = _copy_fixture("tiny_qwen3", tmp / "arch")
    _edit_config(arch, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    cases["unknown_arch"] = (["--hf-dir", str(arch)], "unknown architecture")
    shape = _copy_fixture("tiny_qwen3", tmp / "shape")
    _edit_config(shape, intermediate_size=81)
    cases["shape_mismatch"] = (["--hf-dir", str(shape)], "shape mismatch")
    shard = _copy_fixture("tiny_llama", tmp / "shard")
    (shard / "model-00003-of-00007.safetensors").unlink()
    cases["missing_shard"] = (["--hf-dir", str(shard)], "missing")
    noweights = _copy_fixture("tiny_qwen3", tmp / "noweights")
    (noweights / "model.safetensors").unlink()
    cases["no_weights"] = (["--hf-dir", str(noweights)], "safetensors")
    fewer = _copy_fixture("tiny_qwen3", tmp / "fewer")
    _edit_config(fewer, num_hidden_layers=4)
    cases["missing_layer"] = (["--hf-dir", str(fewer)], "lacks")
    cases["missing_gguf"] = (["--gguf", str(tmp / "model.gguf")], "does not exist")
    notgguf = tmp / "fake.gguf"
    notgguf.write_bytes(b"not a gguf file at all")
    cases["bad_gguf"] = (["--gguf", str(notgguf)], "gguf")
    return cases


def test_cli_errors_are_one_line_and_exit_1(tmp_path):
    for case, (src, phrase) in _broken_checkpoints(tmp_path).items():
        r = _run_cli(*src, "--out", str(tmp_path / f"out_{case}"))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 1, (case, r.stderr)
        assert "Traceback" not in r.stderr, (case, r.stderr)
        assert len(lines) == 1, (case, r.stderr)
        assert lines[0].startswith("error: "), (case, lines)
        assert phrase.lower() in lines[0].lower(), (case, lines)
        assert not (tmp_path / f"out_{case}").exists(), case


def test_cli_converts_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "out"
    r = _run_cli("--hf-dir", str(tiny_dir("tiny_qwen3")), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "converting" in r.stderr  # the tqdm progress bar
    assert checkpoint.is_checkpoint(out)
    r = _run_cli("--hf-dir", str(tiny_dir("tiny_qwen3")), "--out", str(out))
    assert r.returncode == 1 and "--force" in r.stderr and "Traceback" not in r.stderr
