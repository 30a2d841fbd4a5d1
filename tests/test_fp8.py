"""Block-scaled FP8 checkpoints (MiniMax-M2 and the Qwen3 FP8 releases: float8_e4m3fn
``weight`` + float32 ``weight_scale_inv`` per block, ``quantization_config.quant_method ==
"fp8"``): the dequantiser against an explicit per-element computation, the tiny_minimax_m2_fp8
fixture (16x16 blocks, partial ones) against transformers' logits loaded in memory and through
the converter CLI, another architecture (tiny_qwen3) against its dense copy, and malformed
folders failing in one line that names the tensor."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from golden import F32_ATOL, tiny_dir, tiny_golden

from akv_jax.model.causal import greedy_generate
from converters import fp8
from converters.hf_to_jax import main as convert_main
from converters.loading import ModelLoadError, load_model
from converters.sources import open_hf_dir

NAME = "tiny_minimax_m2_fp8"
SRC = tiny_dir(NAME)
EXPERT = "model.layers.1.block_sparse_moe.experts.3.w2.weight"  # [36, 20]: partial blocks
F8 = np.dtype(ml_dtypes.float8_e4m3fn)


# --------------------------------------------------------------------------- helpers


def explicit_dequantize(w: np.ndarray, s: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """One element at a time: value * the scale of the block it lies in."""
    out = np.empty(w.shape, np.float32)
    for idx in np.ndindex(*w.shape):
        *lead, r, c = idx
        out[idx] = np.float32(float(w[idx])) * s[(*lead, r // block[0], c // block[1])]
    return out


def read_raw(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a safetensors file as (dtype, shape, bytes): numpy's loader has no F8."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return {
        k: (v["dtype"], v["shape"], data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
        for k, v in header.items()
    }


def write_raw(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, off = {}, 0
    for k, (dt, shape, b) in tensors.items():
        header[k] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(t[2] for t in tensors.values()))


def _shard_of(d: Path, name: str) -> Path:
    return d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]


def _parity(m, name: str = NAME) -> float:
    g = tiny_golden(name)
    logits, cont = greedy_generate(m.params, m.cfg, g["prompt"].tolist(), 16)
    assert cont == g["continuation"].tolist()
    return float(np.abs(logits - g["logits"]).max())


def _assert_params_equal(a, b) -> None:
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def fp8_model():
    return load_model(SRC, "float32")


# --------------------------------------------------------------------------- the dequantiser


@pytest.mark.parametrize("shape,block", [((3, 37, 21), (16, 8)), ((32, 48), (16, 16)),
                                         ((5, 7), (128, 128))])
def test_dequantize_matches_the_explicit_computation(shape, block):
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * 50).astype(F8)
    s = rng.uniform(1e-4, 1e-1, fp8.scale_shape(shape, block)).astype(np.float32)
    got = fp8.dequantize(w, s, block)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, explicit_dequantize(w, s, block))


def test_quantize_round_trips_through_dequantize():
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((2, 20, 36)).astype(np.float32)
    q, s = fp8.quantize(dense, (16, 16))
    assert q.dtype == F8 and s.shape == (2, 2, 3)
    back = fp8.dequantize(q, s, (16, 16))
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of each block's scale range.
    assert np.abs(back - dense).max() <= np.abs(dense).max() * 2**-4
    np.testing.assert_array_equal(fp8.dequantize(*fp8.quantize(back, (16, 16)), (16, 16)), back)


@pytest.mark.parametrize("case,msg", [
    ("scale_shape", r"fp8 scale w_scale_inv has shape \(2, 2\), expected \(2, 3\)"),
    ("scale_dtype", "fp8 scale w_scale_inv must be float32"),
    ("weight_dtype", "fp8 tensor w must be float8_e4m3fn"),
])
def test_dequantize_rejects_bad_input(case, msg):
    w = np.zeros((20, 36), F8)
    s = np.ones((2, 3), np.float32)
    if case == "scale_shape":
        s = s[:, :2]
    elif case == "scale_dtype":
        s = s.astype(np.float64)
    else:
        w = w.astype(np.float32)
    with pytest.raises(ValueError, match=msg):
        fp8.dequantize(w, s, (16, 16), "w")


# --------------------------------------------------------------------------- the fixture


def test_fixture_is_the_released_layout():
    raw = json.loads((SRC / "config.json").read_text())["quantization_config"]
    assert raw["quant_method"] == "fp8" and raw["weight_block_size"] == [16, 16]
    t = read_raw(_shard_of(SRC, EXPERT))
    assert t[EXPERT][:2] == ("F8_E4M3", [36, 20])
    assert t[EXPERT + "_scale_inv"][:2] == ("F32", [3, 2])  # ceil(36/16), ceil(20/16)
    gate = "model.layers.1.block_sparse_moe.gate.weight"  # modules_to_not_convert: dense
    assert read_raw(_shard_of(SRC, gate))[gate][0] == "F32"
    assert gate + "_scale_inv" not in json.loads(
        (SRC / "model.safetensors.index.json").read_text())["weight_map"]


def test_source_reads_dequantised_tensors_and_consumes_the_scales():
    src = open_hf_dir(SRC)
    assert not any(n.endswith("_scale_inv") for n in src.shapes)
    assert src.shapes[EXPERT] == (36, 20)
    t = read_raw(_shard_of(SRC, EXPERT))
    w = np.frombuffer(t[EXPERT][2], F8).reshape(36, 20)
    s = np.frombuffer(t[EXPERT + "_scale_inv"][2], np.float32).reshape(3, 2)
    got = dict(src.read())
    assert not any(n.endswith("_scale_inv") for n in got)
    assert got[EXPERT].dtype == np.float32
    np.testing.assert_array_equal(got[EXPERT], explicit_dequantize(w, s, (16, 16)))


def test_in_memory_load_matches_transformers(fp8_model):
    # Measured 1.0e-6 (transformers' float32 logits on its own dequantisation of the folder).
    assert _parity(fp8_model) <= F32_ATOL


def test_bfloat16_load_is_the_float32_load_rounded(fp8_model):
    m = load_model(SRC, "bfloat16")
    for got, want in zip(jax.tree_util.tree_leaves(m.params),
                         jax.tree_util.tree_leaves(fp8_model.params), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(jnp.bfloat16))


def test_converter_cli_round_trip(fp8_model, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert convert_main(["--hf-dir", str(SRC), "--out", str(out), "--quiet"]) == 0
    assert "error" not in capsys.readouterr().err
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    m = load_model(out, "float32")
    assert m.cfg == fp8_model.cfg
    _assert_params_equal(m.params, fp8_model.params)


# --------------------------------------------------------------------------- another family


def test_qwen3_fp8_equals_its_dense_dequantised_copy(tmp_path):
    """tiny_qwen3 (tied embeddings, no MoE) quantised here into the FP8 layout: loads equal to
    a dense folder of the explicitly dequantised weights."""
    src = tiny_dir("tiny_qwen3")
    block = (16, 32)
    q_dir, d_dir = tmp_path / "fp8", tmp_path / "dense"
    for d in (q_dir, d_dir):
        d.mkdir()
    tensors = read_raw(src / "model.safetensors")
    quant, dense = {}, {}
    for k, (dt, shape, b) in tensors.items():
        assert dt == "F32"
        if k.endswith("_proj.weight"):
            q, s = fp8.quantize(np.frombuffer(b, np.float32).reshape(shape), block)
            quant[k] = ("F8_E4M3", shape, q.tobytes())
            quant[k + "_scale_inv"] = ("F32", list(s.shape), s.tobytes())
            dense[k] = ("F32", shape, explicit_dequantize(q, s, block).tobytes())
        else:
            quant[k] = dense[k] = (dt, shape, b)
    write_raw(q_dir / "model.safetensors", quant)
    write_raw(d_dir / "model.safetensors", dense)
    cfg = json.loads((src / "config.json").read_text())
    (d_dir / "config.json").write_text(json.dumps(cfg))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (q_dir / "config.json").write_text(json.dumps(cfg))
    _assert_params_equal(load_model(q_dir, "float32").params, load_model(d_dir, "float32").params)


# --------------------------------------------------------------------------- malformed


def _broken(tmp_path: Path, case: str) -> Path:
    d = tmp_path / case
    shutil.copytree(SRC, d)
    shard = _shard_of(d, EXPERT)
    t = read_raw(shard)
    cfg_file = d / "config.json"
    raw = json.loads(cfg_file.read_text())
    q = raw["quantization_config"]
    if case == "missing_scale":
        del t[EXPERT + "_scale_inv"]
    elif case == "scale_shape":
        t[EXPERT + "_scale_inv"] = ("F32", [3, 1], np.ones(3, np.float32).tobytes())
    elif case == "scale_dtype":
        t[EXPERT + "_scale_inv"] = ("F64", [3, 2], np.ones(6, np.float64).tobytes())
    elif case == "scale_without_weight":
        dt, shape, b = t.pop(EXPERT)
        t[EXPERT] = ("F32", shape, np.zeros(shape, np.float32).tobytes())
    elif case == "e5m2_weight":
        t[EXPERT] = ("F8_E5M2", *t[EXPERT][1:])
    elif case == "not_converted_module":
        q["modules_to_not_convert"] = ["gate", EXPERT.removesuffix(".weight")]
    elif case == "fmt":
        q["fmt"] = "e5m2"
    elif case == "ue8m0_scales":
        q["scale_fmt"] = "ue8m0"
    elif case == "bad_pattern":
        q["modules_to_not_convert"] = ["model.layers.(0"]
    elif case == "block_size":
        q["weight_block_size"] = [16]
    elif case == "static_activations":
        q["activation_scheme"] = "static"
    elif case == "no_quantization_config":
        del raw["quantization_config"]
    write_raw(shard, t)
    cfg_file.write_text(json.dumps(raw))
    return d


MALFORMED = {
    "missing_scale": f"fp8 tensor {EXPERT} has no matching {EXPERT}_scale_inv",
    "scale_shape": rf"fp8 scale {EXPERT}_scale_inv has shape \[3, 1\], expected \[3, 2\]",
    "scale_dtype": f"fp8 scale {EXPERT}_scale_inv must be F32, not F64",
    "scale_without_weight": f"fp8 scale {EXPERT}_scale_inv has no fp8 weight: {EXPERT} is not",
    "e5m2_weight": f"fp8 tensor {EXPERT} is F8_E5M2; only F8_E4M3",
    "not_converted_module": f"fp8 tensor {EXPERT} is FP8 but its module is in "
                            "quantization_config.modules_to_not_convert",
    "fmt": r"quantization_config.fmt 'e5m2' is not supported",
    "ue8m0_scales": r"quantization_config.scale_fmt 'ue8m0' is not supported",
    "bad_pattern": r"modules_to_not_convert entry 'model.layers.\(0' is not a valid pattern",
    "block_size": r"quantization_config.weight_block_size must be two positive integers",
    "static_activations": r"quantization_config.activation_scheme 'static' is not supported",
    "no_quantization_config": r"tensor model\.\S+ is F8_E4M3 but \S+config.json has no "
                              "quantization_config",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_folders_fail_in_one_line(tmp_path, case, capsys):
    d = _broken(tmp_path, case)
    with pytest.raises(ModelLoadError, match=MALFORMED[case]) as e:
        load_model(d, "float32")
    assert "\n" not in str(e.value)
    assert convert_main(["--hf-dir", str(d), "--out", str(tmp_path / "o"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_modules_to_not_convert_match_as_transformers_does():
    # transformers' should_convert_module: from the start up to a module boundary, as a regex
    # with that boundary, or as a suffix (its examples, on tensor names' modules).
    cfg = fp8.parse_config({"quant_method": "fp8", "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["model.layers.1", "lm_head", "mlp.gate",
                                                       "model.layers.*.self_attn.o_proj"]},
                           "config.json")
    skipped = ["model.layers.1.mlp.up_proj.weight", "lm_head.weight",
               "model.layers.3.mlp.gate.weight", "model.layers.12.self_attn.o_proj.weight"]
    kept = ["model.layers.11.mlp.up_proj.weight", "model.layers.3.mlp.gate_proj.weight",
            "model.layers.12.self_attn.q_proj.weight"]
    assert [cfg.converts(n) for n in skipped] == [False] * 4
    assert [cfg.converts(n) for n in kept] == [True] * 3
    legacy = fp8.parse_config({"weight_block_size": [128, 128], "ignored_layers": ["lm_head"]},
                              "config.json")
    assert legacy.not_convert == ("lm_head",) and legacy.block == (128, 128)
