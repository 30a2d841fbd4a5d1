"""Qwen3-MoE pieces against transformers' formulas: config forms, the mix of dense and MoE
layers, the MoE block, the converter's expert layouts and the ``tiny-qwen3-moe`` model.
(Logit and greedy parity of the tiny_qwen3_moe fixture runs with the other tiny models in
test_model_parity.py, test_converter.py and test_sharding_multidevice.py; the cache
operations in test_qwen3_moe_ops.py.)"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from golden import tiny_dir
from safetensors.numpy import load_file, save_file

from akv_jax.model.config import ConfigError
from akv_jax.model.forward import layer_period
from akv_jax.model.hf_config import config_from_hf, config_to_hf
from akv_jax.model.moe import moe_mlp
from akv_jax.model.params import params_to_arrays
from converters.loading import ModelLoadError, load_model

# Qwen3-30B-A3B's config.json as released (the fields akv_jax reads).
RELEASED = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def test_released_config_and_transformers5_form():
    cfg = config_from_hf(RELEASED)
    assert cfg.arch == "qwen3_moe" and cfg.qk_norm and cfg.is_moe and not cfg.moe_bias
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_width) == (128, 8, 768)
    assert cfg.intermediate_size == 6144 and cfg.norm_topk_prob and cfg.rope.theta == 1e6
    assert cfg.mlp_layers(moe=True) == tuple(range(48)) and layer_period(cfg) == 1
    assert config_from_hf(config_to_hf(cfg)) == cfg
    # transformers 5's save_pretrained spells the expert count num_local_experts.
    t5 = {k: v for k, v in RELEASED.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert config_from_hf(t5) == cfg
    # transformers' defaults: norm_topk_prob False, every layer sparse.
    bare = {k: v for k, v in RELEASED.items()
            if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
    assert not config_from_hf(bare).norm_topk_prob


def test_dense_layers_from_mlp_only_layers_and_decoder_sparse_step():
    # transformers: MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    cfg = config_from_hf({**RELEASED, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                          "mlp_only_layers": [3]})
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert layer_period(cfg) == 6  # no period: one unrolled group
    assert layer_period(config_from_hf({**RELEASED, "decoder_sparse_step": 3})) == 3
    for bad, msg in [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_experts_per_tok": 129}, "num_experts_per_tok"),
        ({"mlp_only_layers": [48]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            config_from_hf({**RELEASED, **bad})


def test_fixture_config_params_and_layer_groups():
    m = load_model(tiny_dir("tiny_qwen3_moe"))
    cfg, lp = m.cfg, m.params.layers
    assert cfg.mlp_only_layers == (0,) and cfg.expert_width == 18 and cfg.intermediate_size == 56
    assert layer_period(cfg) == 4
    # The dense MLP is stacked over the dense layer only, the experts over the MoE layers.
    assert lp.w_gate.shape == (1, 40, 56) and lp.router.shape == (3, 40, 6)
    assert lp.expert_gate.shape == (3, 6, 40, 18) and lp.expert_down.shape == (3, 6, 18, 40)
    assert lp.router_bias is None and lp.expert_gate_bias is None and lp.q_norm.shape == (4, 12)
    assert config_from_hf(config_to_hf(cfg)) == cfg


def _moe_oracle(cfg, lp, h: np.ndarray) -> np.ndarray:
    """transformers' Qwen3MoeSparseMoeBlock, token by token in float64 numpy."""
    lp = jax.tree.map(lambda a: np.asarray(a, np.float64), lp)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        logits = h[t] @ lp.router
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[: cfg.num_experts_per_tok]
        w = p[top] / p[top].sum() if cfg.norm_topk_prob else p[top]
        for e, we in zip(top, w, strict=True):
            g = h[t] @ lp.expert_gate[e]
            out[t] += we * ((g / (1 + np.exp(-g)) * (h[t] @ lp.expert_up[e])) @ lp.expert_down[e])
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block_matches_per_token_oracle(norm_topk_prob):
    import dataclasses

    m = load_model(tiny_dir("tiny_qwen3_moe"))
    cfg = dataclasses.replace(m.cfg, norm_topk_prob=norm_topk_prob)
    lp0 = jax.tree.map(lambda a: a[1], m.params.layers)  # MoE row 1 = layer 2
    lp0 = dataclasses.replace(lp0, w_gate=None, w_up=None, w_down=None)
    h = np.random.default_rng(0).standard_normal((37, cfg.hidden_size)).astype(np.float32)
    fn = jax.jit(lambda lp, h: moe_mlp(cfg, lp, h))
    got = np.asarray(fn(lp0, jnp.asarray(h)))
    want = _moe_oracle(cfg, lp0, h.astype(np.float64))
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.abs(want).max() > 0.05  # the block contributes
    # grouped_matmul chooses its path when lowering (lax.platform_dependent), so look at the
    # CPU program: no ragged_dot, a loop per grouped matmul (gate, up, down).
    assert jax.default_backend() == "cpu"
    cpu = fn.lower(lp0, jnp.asarray(h)).as_text()
    assert cpu.count("ragged_dot") == 0 and cpu.count("stablehlo.while") >= 3


def test_fused_expert_layout_loads_to_the_same_params():
    """transformers' save_original_format=False layout (gate_up_proj [E, 2F, D] with the gate
    first, down_proj [E, D, F]) and the per-expert one are the same model."""
    a = params_to_arrays(load_model(tiny_dir("tiny_qwen3_moe")).params)
    b = params_to_arrays(load_model(tiny_dir("tiny_qwen3_moe_fused")).params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _edited_fused(tmp_path, edit) -> str:
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dir("tiny_qwen3_moe_fused"), d)
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return str(d)


def test_bad_expert_checkpoints_fail_with_one_line_errors(tmp_path):
    def split_layer1(t):  # layer 1 per expert, expert 3's up_proj missing
        gu = t.pop("model.layers.1.mlp.experts.gate_up_proj")
        dn = t.pop("model.layers.1.mlp.experts.down_proj")
        for e in range(6):
            t[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] = np.ascontiguousarray(gu[e, :18])
            if e != 3:
                t[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = np.ascontiguousarray(
                    gu[e, 18:])
            t[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] = np.ascontiguousarray(dn[e])

    cases = [
        (split_layer1, "lacks tensor model.layers.1.mlp.experts.3.up_proj.weight"),
        (lambda t: t.update({"model.layers.0.mlp.experts.0.gate_proj.weight":
                             np.zeros((18, 40), np.float32)}),
         "layer 0 has a dense MLP"),
        (lambda t: t.update({"model.layers.2.mlp.gate_proj.weight":
                             np.zeros((56, 40), np.float32)}),
         "layer 2 has an MoE MLP"),
        (lambda t: t.update({"model.layers.3.mlp.experts.1.down_proj.weight":
                             np.zeros((40, 18), np.float32)}),
         "both whole and per expert"),
        (lambda t: t.update({"model.layers.3.mlp.experts.6.down_proj.weight":
                             np.zeros((40, 18), np.float32)}),
         "expert 6 >= num_experts 6"),
        (lambda t: t.pop("model.layers.2.mlp.gate.weight"),
         "lacks tensor model.layers.2.mlp.gate.weight"),
    ]
    for i, (edit, msg) in enumerate(cases):
        with pytest.raises(ModelLoadError, match=msg) as e:
            load_model(_edited_fused(tmp_path / str(i), edit))
        assert "\n" not in str(e.value)


def test_tiny_qwen3_moe_model():
    """The named random model (its engine runs against the dense reference in
    test_qwen3_moe_ops.py)."""
    m = load_model("tiny-qwen3-moe")
    assert m.source == "tiny-qwen3-moe" and m.cfg.arch == "qwen3_moe"
    assert layer_period(m.cfg) == 2  # (dense, MoE) pairs scanned
    assert m.params.layers.w_gate.shape[0] == m.params.layers.router.shape[0] == 2
    assert m.tokenizer is not None and m.tokenizer.vocab_size == m.cfg.vocab_size


def test_tiny_qwen3_moe_chat_segments_with_reasoning():
    """tiny-qwen3-moe's Qwen3-style template drops an assistant turn's reasoning once a user
    message follows: each segment is still its message's text in the full rendering, and the
    segments concatenate to apply_chat_template."""
    tok = load_model("tiny-qwen3-moe").tokenizer
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "done", "reasoning_content": "use 42"},
    ]
    segs = tok.encode_messages(msgs, add_generation_prompt=False)
    assert [t for s in segs for t in s] == tok.apply_chat_template(msgs, False)
    assert [tok.decode(s) for s in segs] == [
        "<|im_start|>system\nbe brief<|im_end|>\n",
        "<|im_start|>user\nhi<|im_end|>\n",
        "<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nhello<|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n<think>\nuse 42\n</think>\n\ndone<|im_end|>\n",
    ]
    later = tok.encode_messages([*msgs, {"role": "user", "content": "bye"}], True)
    assert later[:2] == segs[:2] and later[3] == segs[3]  # stable before the reasoning turn
    assert tok.decode(later[2]) == "<|im_start|>assistant\nhello<|im_end|>\n"
    assert tok.decode(later[-1]) == "<|im_start|>assistant\n"
    off = tok.encode_messages(msgs[:2], True, enable_thinking=False)
    assert tok.decode(off[-1]) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
