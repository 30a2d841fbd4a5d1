"""GPT-OSS checkpoints as released, with MXFP4 expert weights (``*_blocks`` / ``*_scales`` and
``quantization_config.quant_method == "mxfp4"``): loaded in memory and through the converter,
against transformers' ``Mxfp4Config(dequantize=True)`` logits (fixture tiny_gpt_oss_mxfp4) and
against the same model saved dense; and ``--moe-weight-format mxfp4`` (experts kept packed on
the device) against the dequantised weights."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_cases import engine_greedy
from golden import F32_ATOL, tiny_dir, tiny_golden
from mxfp4_reference import naive_dequantize
from safetensors.numpy import load_file, save_file

from akv_jax.model.causal import greedy_generate
from akv_jax.model.params import (
    cast_params,
    make_mesh,
    params_from_arrays,
    params_to_arrays,
    shard_params,
)
from akv_jax.pallas.grouped_matmul import Mxfp4Weight, dequantize_mxfp4, grouped_matmul
from converters import mxfp4
from converters.hf_to_jax import main as convert_main
from converters.loading import ModelLoadError, load_model, pack_experts

REPO = Path(__file__).resolve().parent.parent
NAME = "tiny_gpt_oss_mxfp4"
SRC = tiny_dir(NAME)


def _parity(m) -> float:
    g = tiny_golden(NAME)
    logits, cont = greedy_generate(m.params, m.cfg, g["prompt"].tolist(), 16)
    assert cont == g["continuation"].tolist()
    return float(np.abs(logits - g["logits"]).max())


def _assert_params_equal(a, b) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def mxfp4_model():
    return load_model(SRC, "float32")


def test_fixture_is_the_released_layout():
    raw = json.loads((SRC / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "mxfp4"
    t = load_file(str(SRC / "model.safetensors"))
    blocks = t["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert blocks.dtype == np.uint8 and blocks.shape == (5, 2 * 64, 96 // 32, 16)
    assert t["model.layers.0.mlp.experts.down_proj_scales"].shape == (5, 96, 64 // 32)
    assert not any(k.endswith(("gate_up_proj", "down_proj")) for k in t)


def test_in_memory_load_matches_transformers_dequantised(mxfp4_model):
    # Measured 3.3e-6 (transformers' own float32 logits, MXFP4 dequantised on load).
    assert _parity(mxfp4_model) <= F32_ATOL


def test_converter_round_trip_matches_transformers(mxfp4_model, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert convert_main(["--hf-dir", str(SRC), "--out", str(out), "--quiet"]) == 0
    assert "error" not in capsys.readouterr().err
    m = load_model(out, "float32")
    assert m.cfg == mxfp4_model.cfg
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    _assert_params_equal(m.params, mxfp4_model.params)
    assert _parity(m) <= F32_ATOL


def _dense_copy(tmp_path):
    """The fixture saved dense ([E, in, out] float32, dequantised one element at a time)."""
    dense = tmp_path / "dense"
    dense.mkdir()
    t = load_file(str(SRC / "model.safetensors"))
    for name in [k for k in t if k.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        t[base] = naive_dequantize(t.pop(name), t.pop(f"{base}_scales")).astype(np.float32)
    save_file(t, str(dense / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((SRC / "config.json").read_text())
    del raw["quantization_config"]
    (dense / "config.json").write_text(json.dumps(raw))
    return dense


def test_equals_the_dense_folder_of_the_dequantised_weights(mxfp4_model, tmp_path):
    m = load_model(_dense_copy(tmp_path), "float32")
    assert m.cfg == mxfp4_model.cfg
    _assert_params_equal(m.params, mxfp4_model.params)
    g = tiny_golden(NAME)
    a, ca = greedy_generate(m.params, m.cfg, g["prompt"].tolist(), 4)
    b, cb = greedy_generate(mxfp4_model.params, mxfp4_model.cfg, g["prompt"].tolist(), 4)
    np.testing.assert_array_equal(a, b)
    assert ca == cb


def test_bfloat16_load_holds_the_dequantised_values_exactly(mxfp4_model):
    m = load_model(SRC, "bfloat16")
    for field in ("expert_gate", "expert_up", "expert_down"):
        got = getattr(m.params.layers, field)
        want = getattr(mxfp4_model.params.layers, field)
        assert got.dtype == jnp.bfloat16
        # Every MXFP4 value of this fixture is a bfloat16: nothing is rounded.
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want))


def _broken(tmp_path, case: str):
    d = tmp_path / case
    shutil.copytree(SRC, d)
    st = d / "model.safetensors"
    t = load_file(str(st))
    raw = json.loads((d / "config.json").read_text())
    name = "model.layers.2.mlp.experts.down_proj"
    if case == "missing_scales":
        del t[f"{name}_scales"]
    elif case == "missing_blocks":
        del t[f"{name}_blocks"]
    elif case == "shape_mismatch":
        t[f"{name}_scales"] = t[f"{name}_scales"][:, :-1]
    elif case == "wrong_dtype":
        t[f"{name}_blocks"] = t[f"{name}_blocks"].astype(np.int8)
    elif case == "dense_and_packed":
        t[name] = np.zeros((5, 64, 96), np.float32)
    elif case == "config_lacks_quantization":
        del raw["quantization_config"]
    elif case == "other_quant_method":
        raw["quantization_config"] = {"quant_method": "awq"}
    elif case == "wrong_dense_shape":  # blocks and scales agree, the config does not
        t[f"{name}_blocks"] = t[f"{name}_blocks"][:, :-1]
        t[f"{name}_scales"] = t[f"{name}_scales"][:, :-1]
    save_file(t, str(st), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(raw))
    return d


BROKEN = {
    "missing_scales": "down_proj_blocks has no matching model.layers.2.mlp.experts.down_proj_sc",
    "missing_blocks": "down_proj_scales has no matching model.layers.2.mlp.experts.down_proj_bl",
    "shape_mismatch": "mxfp4 shape mismatch for model.layers.2.mlp.experts.down_proj",
    "wrong_dtype": "model.layers.2.mlp.experts.down_proj_blocks must be uint8",
    "dense_and_packed": "model.layers.2.mlp.experts.down_proj is stored both dense and as mxfp4",
    "config_lacks_quantization": "has no quantization_config",
    "other_quant_method": "quant_method 'awq' is not supported",
    "wrong_dense_shape": "shape mismatch for model.layers.2.mlp.experts.down_proj",
}


@pytest.mark.parametrize("case", BROKEN)
def test_malformed_checkpoints_fail_in_one_line_naming_the_tensor(case, tmp_path, capsys):
    d = _broken(tmp_path, case)
    with pytest.raises(ModelLoadError) as e:
        load_model(d)
    msg = str(e.value)
    assert BROKEN[case] in msg and "\n" not in msg, msg
    assert convert_main(["--hf-dir", str(d), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and BROKEN[case] in err[0], err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------- --moe-weight-format mxfp4


def test_jnp_dequantize_equals_the_converters():
    t = load_file(str(SRC / "model.safetensors"))
    for proj in ("gate_up_proj", "down_proj"):
        b = t[f"model.layers.1.mlp.experts.{proj}_blocks"]
        s = t[f"model.layers.1.mlp.experts.{proj}_scales"]
        got = dequantize_mxfp4(jnp.asarray(b), jnp.asarray(s), jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), naive_dequantize(b, s).astype(np.float32))


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot"])
def test_grouped_matmul_with_packed_rhs_equals_dense(impl):
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((3, 64, 40)).astype(np.float32)
    w = Mxfp4Weight(*(jnp.asarray(a) for a in mxfp4.quantize(dense)))
    assert w.shape == dense.shape
    dq = jnp.asarray(mxfp4.dequantize(np.asarray(w.blocks), np.asarray(w.scales)))
    x = jnp.asarray(rng.standard_normal((37, 64)).astype(np.float32))
    sizes = jnp.asarray([10, 0, 27], jnp.int32)
    got = grouped_matmul(x, w, sizes, impl=impl, tile=8)
    want = grouped_matmul(x, dq, sizes, impl=impl, tile=8)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


EXPERTS = ("expert_gate", "expert_up", "expert_down")


def _released_packed(field: str) -> tuple[np.ndarray, np.ndarray]:
    """The fixture's own bytes of ``field``, stacked over layers: gate_up_proj's out rows are
    interleaved (gate 0::2, up 1::2), read here straight from the file."""
    t = load_file(str(SRC / "model.safetensors"))
    proj, rows = {
        "expert_gate": ("gate_up_proj", slice(0, None, 2)),
        "expert_up": ("gate_up_proj", slice(1, None, 2)),
        "expert_down": ("down_proj", slice(None)),
    }[field]
    name = "model.layers.{}.mlp.experts." + proj
    return tuple(  # type: ignore[return-value]
        np.stack([t[name.format(i) + part][:, rows] for i in range(4)])
        for part in ("_blocks", "_scales")
    )


def _dequantised(params):
    return jax.tree.map(
        lambda w: dequantize_mxfp4(w.blocks, w.scales, jnp.float32)
        if isinstance(w, Mxfp4Weight) else w,
        params, is_leaf=lambda w: isinstance(w, Mxfp4Weight),
    )


@pytest.fixture(scope="module")
def packed_model():
    return load_model(SRC, "float32", moe_weight_format="mxfp4")


def test_packed_load_keeps_the_released_bytes(packed_model, mxfp4_model):
    """The direct load against the dequantise + requantise path it replaces: the same
    values bit for bit, every other param identical, and the packed bytes the file's own."""
    requantised = pack_experts(mxfp4_model.cfg, mxfp4_model.params)
    _assert_params_equal(_dequantised(packed_model.params), _dequantised(requantised))
    _assert_params_equal(_dequantised(packed_model.params), mxfp4_model.params)
    differ = 0
    for field in EXPERTS:
        w = getattr(packed_model.params.layers, field)
        assert isinstance(w, Mxfp4Weight) and w.blocks.dtype == w.scales.dtype == jnp.uint8
        blocks, scales = _released_packed(field)
        np.testing.assert_array_equal(np.asarray(w.blocks), blocks)
        np.testing.assert_array_equal(np.asarray(w.scales), scales)
        differ += int((np.asarray(getattr(requantised.layers, field).scales) != scales).sum())
    # Not the requantiser's bytes: it takes the smallest scale that fits each block's peak,
    # and a block whose peak the rounding lowered (3.4 -> 3) re-encodes one scale lower.
    assert differ > 0


def test_packed_load_never_builds_dense_experts(monkeypatch, mxfp4_model):
    cfg = mxfp4_model.cfg
    dense_bytes = sum(np.asarray(getattr(mxfp4_model.params.layers, f)).nbytes for f in EXPERTS)
    load_model(SRC, "float32", moe_weight_format="mxfp4")  # imports and caches warm

    def refuse(*a, **k):
        raise AssertionError("an expert weight was decoded or quantised on the host")

    monkeypatch.setattr(mxfp4, "dequantize", refuse)
    monkeypatch.setattr(mxfp4, "quantize", refuse)
    tracemalloc.start()
    try:
        m = load_model(SRC, "float32", moe_weight_format="mxfp4")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert m.cfg == cfg and isinstance(m.params.layers.expert_up, Mxfp4Weight)
    # Every host allocation of the load together (numpy reports to tracemalloc) stays below
    # what the dense float32 experts alone would take (measured 1.08 MB against 1.47 MB; the
    # dequantising load peaks at 2.90 MB).
    assert peak < dense_bytes, (peak, dense_bytes)


def test_converter_keeps_experts_packed(packed_model, mxfp4_model, tmp_path, capsys):
    out = tmp_path / "packed"
    argv = ["--hf-dir", str(SRC), "--out", str(out), "--quiet", "--moe-weight-format", "mxfp4"]
    assert convert_main(argv) == 0
    assert "MXFP4 experts" in capsys.readouterr().out
    m = load_model(out, "float32", moe_weight_format="mxfp4")
    assert m.cfg == packed_model.cfg
    _assert_params_equal(m.params, packed_model.params)  # the released bytes, as loaded
    # Served dense, the packed checkpoint dequantises to what the dense load holds.
    _assert_params_equal(load_model(out, "float32").params, mxfp4_model.params)
    b = load_model(out, "bfloat16", moe_weight_format="mxfp4").params
    assert b.embed.dtype == jnp.bfloat16 and b.layers.expert_gate.blocks.dtype == jnp.uint8


@pytest.mark.parametrize(
    "case, phrase",
    [
        ("blocks_shape", "shape mismatch for layers.expert_down.blocks: got (4, 5, 96, 1, 16)"),
        ("scales_dtype", "packed parameter layers.expert_down.scales must be uint8"),
        ("no_scales", "missing parameter layers.expert_down.scales"),
        ("not_an_expert", "parameter layers.router cannot be stored packed"),
    ],
)
def test_packed_arrays_are_checked(packed_model, case, phrase):
    arrays = params_to_arrays(packed_model.params)
    name = "layers.expert_down"
    if case == "blocks_shape":
        arrays[f"{name}.blocks"] = arrays[f"{name}.blocks"][:, :, :, :1]
    elif case == "scales_dtype":
        arrays[f"{name}.scales"] = arrays[f"{name}.scales"].astype(np.int8)
    elif case == "no_scales":
        del arrays[f"{name}.scales"]
    else:
        w = arrays.pop("layers.router")
        arrays["layers.router.blocks"] = w
    with pytest.raises(ValueError, match=re.escape(phrase)):
        params_from_arrays(packed_model.cfg, arrays)


def test_converter_refuses_to_quantise_dense_experts(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--hf-dir", str(_dense_copy(tmp_path)), "--out", str(out), "--quiet",
            "--moe-weight-format", "mxfp4"]
    assert convert_main(argv) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "keeps MXFP4 expert weights packed" in err[0], err
    assert not out.exists()


def test_packed_serving_equals_dequantised_serving(packed_model, mxfp4_model):
    m = packed_model
    for field in EXPERTS:
        w = getattr(m.params.layers, field)
        assert isinstance(w, Mxfp4Weight) and w.blocks.dtype == jnp.uint8
        dense = getattr(mxfp4_model.params.layers, field)
        np.testing.assert_array_equal(
            np.asarray(dequantize_mxfp4(w.blocks, w.scales, jnp.float32)), np.asarray(dense)
        )
    g = tiny_golden(NAME)
    prompt = g["prompt"].tolist()
    a, ca = greedy_generate(m.params, m.cfg, prompt, 16)
    b, cb = greedy_generate(mxfp4_model.params, mxfp4_model.cfg, prompt, 16)
    # The same weights; XLA fuses the dequantisation into the products, so the float32
    # summation order differs (measured max 1.9e-6).
    assert np.abs(a - b).max() <= 1e-5
    assert ca == cb == g["continuation"].tolist()
    assert engine_greedy(m, [prompt[:100], prompt[:37]], 6) == engine_greedy(
        mxfp4_model, [prompt[:100], prompt[:37]], 6
    )


def test_packed_params_shard_and_cast(packed_model):
    m = packed_model
    p = shard_params(m.params, m.cfg, make_mesh(1, jax.devices()[:1]))
    assert isinstance(p.layers.expert_down, Mxfp4Weight)
    c = cast_params(p, jnp.bfloat16)
    assert c.embed.dtype == jnp.bfloat16 and c.layers.expert_down.scales.dtype == jnp.uint8


@pytest.mark.parametrize(
    "name, phrase", [("tiny", "mixture-of-experts"), ("tiny-gpt-oss", "multiple of 32")]
)
def test_packed_format_refuses_models_it_cannot_pack(name, phrase):
    with pytest.raises(ModelLoadError, match=phrase):
        load_model(name, moe_weight_format="mxfp4")
    with pytest.raises(ModelLoadError, match="unknown MoE weight format"):
        load_model(name, moe_weight_format="int4")


_TP2 = """
import jax, numpy as np
from golden import tiny_dir, tiny_golden
from akv_jax.model.causal import greedy_generate
from akv_jax.model.params import make_mesh, shard_params
from converters.loading import load_model
m = load_model(tiny_dir("tiny_gpt_oss_mxfp4"), moe_weight_format="mxfp4")
prompt = tiny_golden("tiny_gpt_oss_mxfp4")["prompt"].tolist()[:48]
a, ca = greedy_generate(m.params, m.cfg, prompt, 3)
s = shard_params(m.params, m.cfg, make_mesh(2))
assert s.layers.expert_up.blocks.sharding.spec[2] == "tensor"  # out = F, split
assert s.layers.expert_down.blocks.sharding.spec[3] == "tensor"  # in/32 = F/32, split
b, cb = greedy_generate(s, m.cfg, prompt, 3)
assert np.abs(a - b).max() <= 1e-5 and ca == cb, (np.abs(a - b).max(), ca, cb)
print("ok")
"""


def test_packed_experts_are_tensor_parallel():
    """tp=2 over two host devices (its own process: the device count is fixed at start)."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
    }
    r = subprocess.run(
        [sys.executable, "-c", _TP2], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=600,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_server_flag_loads_packed_experts():
    from akv_jax.serving.main import StartupError, build_engine, build_parser

    args = build_parser().parse_args(
        ["--model-path", str(SRC), "--moe-weight-format", "mxfp4", "--skip-warmup",
         "--max-total-tokens", "256"]
    )
    model, _ = build_engine(args)
    assert isinstance(model.params.layers.expert_gate, Mxfp4Weight)
    assert build_parser().parse_args([]).moe_weight_format == "dense"
    args = build_parser().parse_args(["--model-path", "tiny", "--moe-weight-format", "mxfp4"])
    with pytest.raises(StartupError, match="cannot load tiny: .*mixture-of-experts"):
        build_engine(args)
