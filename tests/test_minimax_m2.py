"""MiniMax-M2 pieces against transformers' formulas and the dense reference: config forms
(partial rotary from ``rotary_dim`` / ``partial_rotary_factor``), the sigmoid-routed MoE block,
the q/k norm over all heads, repos under partial rotary, both checkpoint layouts, and the
``tiny-minimax-m2`` model with its chat template. (Logit and greedy parity of the
tiny_minimax_m2 fixture runs with the other tiny models in test_model_parity.py,
test_converter.py and test_sharding_multidevice.py.)"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from golden import tiny_dir

from akv_jax.cache.dense_reference import reference_rope
from akv_jax.model.config import ConfigError
from akv_jax.model.forward import rms_norm_over_heads
from akv_jax.model.hf_config import config_from_hf, config_to_hf
from akv_jax.model.moe import moe_mlp, route_sigmoid
from akv_jax.model.rope import hf_inv_freq, rope_table_for
from akv_jax.pallas.rotary import apply_rope, rerotate
from converters.loading import ModelLoadError, load_model

NAME = "tiny_minimax_m2"
# The released MiniMax-M2 config.json's fields that matter here (rotary_dim as the top-level
# key, rope_theta legacy form, qk norm flags), at toy sizes.
RELEASED_FORM = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "num_hidden_layers": 62,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rotary_dim": 64,
    "rope_theta": 5000000,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "bos_token_id": 200034,
    "eos_token_id": 200020,
}


@pytest.fixture(scope="module")
def fixture_model():
    return load_model(tiny_dir(NAME))


def test_config_forms_and_errors(fixture_model):
    cfg = config_from_hf(RELEASED_FORM)
    assert cfg.arch == "minimax_m2" and cfg.rotary_dim == 64 and cfg.rope_dim == 64
    assert cfg.rope.theta == 5e6 and cfg.qk_norm_over_heads and cfg.sigmoid_router
    # transformers' order: rope_parameters' factor, then a top-level one, then rotary_dim.
    rope = {"rope_theta": 1e4, "partial_rotary_factor": 0.25}
    nested = {**RELEASED_FORM, "rope_parameters": rope}
    assert config_from_hf(nested).rotary_dim == 32
    assert config_from_hf({**RELEASED_FORM, "partial_rotary_factor": 0.75}).rotary_dim == 96
    full = {k: v for k, v in RELEASED_FORM.items() if k != "rotary_dim"}
    assert config_from_hf(full).rotary_dim is None and config_from_hf(full).rope_dim == 128
    assert config_from_hf(full).rope.theta == 5e6  # MiniMaxM2Config.default_theta
    # The fixture's config.json, as transformers 5.24 writes it (rope_parameters + rotary_dim).
    cfg = fixture_model.cfg
    raw = json.loads((tiny_dir(NAME) / "config.json").read_text())
    assert raw["rope_parameters"]["partial_rotary_factor"] == 0.5 and raw["rotary_dim"] == 16
    assert cfg.rotary_dim == 16 and cfg.head_dim == 32
    assert config_from_hf(config_to_hf(cfg)) == cfg
    with pytest.raises(ConfigError, match="rotary dims"):
        config_from_hf({**RELEASED_FORM, "rotary_dim": 63})
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        config_from_hf({**RELEASED_FORM, "num_experts_per_tok": 0})


def test_fixture_layout(fixture_model):
    lp = fixture_model.params.layers
    assert lp.q_norm.shape == (3, 4, 32) and lp.k_norm.shape == (3, 2, 32)  # over all heads
    assert lp.expert_gate.shape == (3, 6, 36, 20) and lp.expert_down.shape == (3, 6, 20, 36)
    assert lp.router.shape == (3, 36, 6) and lp.router_score_bias.shape == (3, 6)
    assert lp.router_bias is None and lp.expert_gate_bias is None and lp.w_gate is None
    assert rope_table_for(fixture_model.cfg).cos.shape[-1] == 8  # 16 rotary dims


def _moe_oracle(cfg, lp, h: np.ndarray) -> tuple[np.ndarray, list[set[int]]]:
    """transformers' MiniMaxM2SparseMoeBlock token by token in float64 numpy: the block's
    output and each token's chosen experts."""
    lp = jax.tree.map(lambda a: np.asarray(a, np.float64), lp)
    out, chosen = np.zeros_like(h), []
    for t in range(h.shape[0]):
        scores = 1 / (1 + np.exp(-(h[t] @ lp.router)))
        top = np.argsort(-(scores + lp.router_score_bias))[: cfg.num_experts_per_tok]
        w = scores[top] / scores[top].sum()
        chosen.append(set(top.tolist()))
        for e, we in zip(top, w, strict=True):
            g = h[t] @ lp.expert_gate[e]
            out[t] += we * ((g / (1 + np.exp(-g)) * (h[t] @ lp.expert_up[e])) @ lp.expert_down[e])
    return out, chosen


def test_moe_block_matches_per_token_oracle(fixture_model):
    m = fixture_model
    lp0 = jax.tree.map(lambda a: a[0], m.params.layers)
    h = np.random.default_rng(0).standard_normal((41, m.cfg.hidden_size)).astype(np.float32)
    got = np.asarray(jax.jit(lambda lp, h: moe_mlp(m.cfg, lp, h))(lp0, jnp.asarray(h)))
    want, chosen = _moe_oracle(m.cfg, lp0, h.astype(np.float64))
    np.testing.assert_allclose(got, want, atol=2e-5)
    idx, w = jax.jit(lambda lp, h: route_sigmoid(m.cfg, lp, h @ lp.router))(lp0, jnp.asarray(h))
    assert [set(r) for r in np.asarray(idx).tolist()] == chosen
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, atol=1e-6)  # renormalised
    # The correction bias only chooses: without it other experts win for some tokens.
    no_bias = dataclasses.replace(lp0, router_score_bias=jnp.zeros(6))
    _, unbiased = _moe_oracle(m.cfg, no_bias, h.astype(np.float64))
    assert sum(a != b for a, b in zip(chosen, unbiased, strict=True)) >= 3


def test_qk_norm_spans_all_heads():
    """The norm of [T, H, Dh] is over the whole H*Dh projection (transformers' q_norm on
    ``q_proj(x)`` before the head split), not per head."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 4, 8)).astype(np.float32) * np.arange(1, 5)[None, :, None]
    w = (1 + 0.1 * rng.standard_normal((4, 8))).astype(np.float32)
    got = np.asarray(rms_norm_over_heads(jnp.asarray(x), jnp.asarray(w), 1e-6))
    flat = x.reshape(5, -1).astype(np.float64)
    want = w.reshape(-1) * flat / np.sqrt((flat**2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got.reshape(5, -1), want, rtol=2e-6, atol=2e-6)


def test_partial_rotary_append_and_repos_exact(fixture_model):
    """Only the 16 rotary dims of a 32-dim head rotate, in append and in repos: rotating a
    stored key by a position delta equals rotating the raw key at the new position (against
    the dense reference's own float64 rotation), and the other 16 dims keep their bits."""
    cfg = fixture_model.cfg
    tab = rope_table_for(cfg, 5000)
    inv = hf_inv_freq(cfg.rope, cfg.rope_dim)
    k = np.random.default_rng(1).standard_normal((7, 2, cfg.head_dim)).astype(np.float32)
    old = np.array([0, 5, 300, 1000, 4000, 17, 4999])
    new = np.array([3000, 6, 2, 4999, 100, 17, 0])
    kj = jnp.asarray(k)
    stored = apply_rope(kj, jnp.asarray(old), tab)
    moved = np.asarray(rerotate(stored, jnp.asarray(old), jnp.asarray(new), tab))
    np.testing.assert_allclose(
        np.asarray(stored), reference_rope(k.astype(np.float64), old, inv), atol=1e-5
    )
    np.testing.assert_allclose(moved, reference_rope(k.astype(np.float64), new, inv), atol=1e-5)
    np.testing.assert_allclose(moved, np.asarray(apply_rope(kj, jnp.asarray(new), tab)),
                               atol=3e-6)
    r = cfg.rope_dim
    assert np.array_equal(moved[..., r:].view(np.uint32), k[..., r:].view(np.uint32))
    assert np.abs(moved[..., :r] - k[..., :r]).max() > 0.5  # the rotary dims did move


def _write_fused_layout(src, dst) -> None:
    """The fixture in transformers' in-memory layout (``mlp.gate``, ``mlp.e_score_correction_
    bias``, ``mlp.experts.gate_up_proj`` [E, 2F, D] = per expert cat(w1, w3), ``down_proj``
    [E, D, F]): what transformers' MergeModulelist + Concatenate(dim=1) build from the
    released tensors."""
    from safetensors.numpy import load_file, save_file

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    cfg = json.loads((src / "config.json").read_text())
    out = {}
    for name, w in tensors.items():
        if ".experts." not in name:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = w
    E = cfg["num_local_experts"]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.block_sparse_moe.experts"
        w = {n: [tensors[f"{pre}.{e}.{n}.weight"] for e in range(E)] for n in ("w1", "w2", "w3")}
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([a, b]) for a, b in zip(w["w1"], w["w3"], strict=True)])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(w["w2"])
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(out, str(dst / "model.safetensors"))


def test_both_checkpoint_layouts_load_the_same_model(fixture_model, tmp_path):
    fused = tmp_path / "fused"
    _write_fused_layout(tiny_dir(NAME), fused)
    m = load_model(fused)
    ref = jax.tree.leaves(fixture_model.params)
    # The same params, bit for bit, as the released layout (whose logits test_model_parity
    # checks against transformers).
    assert m.cfg == fixture_model.cfg
    for a, b in zip(jax.tree.leaves(m.params), ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _copy_without(tmp_path, drop: str, rename: tuple[str, str] | None = None):
    from safetensors.numpy import load_file, save_file

    dst = tmp_path / "ckpt"
    dst.mkdir(parents=True)
    shutil.copy(tiny_dir(NAME) / "config.json", dst / "config.json")
    tensors = {}
    for f in sorted(tiny_dir(NAME).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    tensors.pop(drop)
    if rename:
        tensors[rename[1]] = tensors.pop(rename[0])
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_bad_checkpoints_one_line_errors(tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.4.w3.weight"
    with pytest.raises(ModelLoadError, match=f"lacks tensor {name.replace('.', '[.]')}$"):
        load_model(_copy_without(tmp_path / "a", name))
    w1 = "model.layers.0.block_sparse_moe.experts.2.w1.weight"
    bad = w1.replace("experts.2", "experts.6")
    with pytest.raises(ModelLoadError, match="expert 6 >= num_local_experts 6"):
        load_model(_copy_without(tmp_path / "b", w1.replace("w1", "w2"), (w1, bad)))
    fp8 = tmp_path / "fp8"
    shutil.copytree(tiny_dir(NAME), fp8)
    raw = json.loads((fp8 / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(raw))
    # FP8 releases load (tests/test_fp8.py); a dense folder claiming to be one does not.
    with pytest.raises(ModelLoadError, match="quant_method is 'fp8' but no tensor is float8") as e:
        load_model(fp8)
    assert "\n" not in str(e.value)


def test_tiny_minimax_m2_model_and_template():
    m = load_model("tiny-minimax-m2")
    assert m.source == "tiny-minimax-m2" and m.cfg.arch == "minimax_m2"
    assert m.cfg.rotary_dim == 8 and m.cfg.head_dim == 16
    tok = m.tokenizer
    assert tok.vocab_size == m.cfg.vocab_size
    assert m.cfg.bos_token_id == tok.token_to_id("]~!b[") and m.stop_ids == (511,)
    msgs = [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "a.txt"},
    ]
    text = tok.render(msgs, add_generation_prompt=True)
    assert text == (
        "]~!b[]~b]system\nYou are a helpful assistant.[e~[\n]~b]user\nlist files[e~[\n"
        "]~b]ai\nok[e~[\n]~b]tool\n<response>a.txt</response>[e~[\n]~b]ai\n<think>\n"
    )
    segs = tok.encode_messages(msgs, add_generation_prompt=True)
    assert len(segs) == 4 and sum(segs, []) == tok.apply_chat_template(msgs, True)
    assert tok.decode(segs[2]) == "]~b]tool\n<response>a.txt</response>[e~[\n"
    # (The engine on tiny-minimax-m2 against the dense reference: test_minimax_m2_ops.py.)
