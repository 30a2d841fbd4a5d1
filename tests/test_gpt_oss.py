"""GPT-OSS pieces against transformers: config forms, YaRN, the MoE block, repos under YaRN,
and the ``tiny-gpt-oss`` model. (Logit and greedy parity of the tiny_gpt_oss fixture runs with
the other tiny models in test_model_parity.py and test_converter.py.)"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_cases import engine_greedy
from golden import GOLDEN, tiny_dir, tiny_golden

from akv_jax.model.causal import greedy_generate
from akv_jax.model.config import ConfigError
from akv_jax.model.forward import layer_period, rope_scaled
from akv_jax.model.hf_config import config_from_hf, config_to_hf
from akv_jax.model.moe import moe_mlp
from akv_jax.model.rope import hf_inv_freq, rope_table_for
from akv_jax.pallas.rotary import rerotate
from converters.loading import load_model

ROPE_CASES = json.loads((GOLDEN / "gpt_oss_rope.json").read_text())


@pytest.mark.parametrize("i", range(len(ROPE_CASES)))
def test_yarn_inv_freq_and_attention_factor_match_transformers(i):
    case = ROPE_CASES[i]
    cfg = config_from_hf(case["config"])
    assert cfg.rope.rope_type == "yarn"
    ours = hf_inv_freq(cfg.rope, cfg.head_dim)
    # Within 2 float32 ulp: torch's vectorised float32 pow is not reproducible bit for bit in
    # numpy (the model's logits stay within 1.2e-6 of transformers' with it).
    np.testing.assert_array_max_ulp(ours, np.float32(case["inv_freq"]), maxulp=2)
    assert cfg.rope.attention_scaling() == pytest.approx(case["attention_scaling"], rel=1e-12)
    # The config reads back to itself through config_to_hf.
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_released_config_form_and_defaults():
    legacy = ROPE_CASES[0]["config"]
    assert "rope_scaling" in legacy and "truncate" not in legacy["rope_scaling"]
    cfg = config_from_hf(legacy)
    assert cfg.arch == "gpt_oss" and cfg.rope.truncate  # transformers: get("truncate", True)
    assert cfg.rope.theta == 150000.0 and cfg.rope.factor == 32.0
    # transformers' GptOssConfig defaults where config.json is silent.
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert cfg.attention_bias and cfg.attention_sinks and cfg.is_moe
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert cfg.head_dim * cfg.num_heads != cfg.hidden_size
    assert ROPE_CASES[1]["config"]["rope_parameters"]["truncate"] is False
    assert not config_from_hf(ROPE_CASES[1]["config"]).rope.truncate
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        config_from_hf({**legacy, "num_experts_per_tok": 9})


def test_fixture_config_and_layer_groups():
    m = load_model(tiny_dir("tiny_gpt_oss"))
    cfg = m.cfg
    assert cfg.swiglu_limit == 0.8 and cfg.sliding_window == 12 and not cfg.rope.truncate
    assert layer_period(cfg) == 2  # the scan runs over (sliding, full) pairs
    assert config_from_hf(config_to_hf(cfg)) == cfg
    lp = m.params.layers
    assert lp.w_gate is None and lp.expert_gate.shape == (4, 5, 40, 28)
    assert lp.sinks.shape == (4, 4) and lp.bq.shape == (4, 4, 24)


def _moe_oracle(cfg, lp, h: np.ndarray) -> np.ndarray:
    """transformers' GptOssMLP, token by token in float64 numpy."""
    lp = jax.tree.map(lambda a: np.asarray(a, np.float64), lp)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        logits = h[t] @ lp.router + lp.router_bias
        top = np.argsort(-logits)[: cfg.num_experts_per_tok]
        w = np.exp(logits[top] - logits[top].max())
        w /= w.sum()
        for e, we in zip(top, w, strict=True):
            gate = np.minimum(h[t] @ lp.expert_gate[e] + lp.expert_gate_bias[e], cfg.swiglu_limit)
            up = np.clip(h[t] @ lp.expert_up[e] + lp.expert_up_bias[e], -cfg.swiglu_limit,
                         cfg.swiglu_limit)
            act = (up + 1) * gate / (1 + np.exp(-cfg.swiglu_alpha * gate))
            out[t] += we * (act @ lp.expert_down[e] + lp.expert_down_bias[e])
    return out


def test_moe_block_matches_per_token_oracle_with_grouped_matmuls():
    m = load_model(tiny_dir("tiny_gpt_oss"))
    lp0 = jax.tree.map(lambda a: a[0], m.params.layers)
    h = np.random.default_rng(0).standard_normal((37, m.cfg.hidden_size)).astype(np.float32)
    fn = jax.jit(lambda lp, h: moe_mlp(m.cfg, lp, h))
    got = np.asarray(fn(lp0, jnp.asarray(h)))
    np.testing.assert_allclose(got, _moe_oracle(m.cfg, lp0, h.astype(np.float64)), atol=2e-5)
    # Grouped matmuls over the tokens sorted by expert, no dense product over all experts: on
    # the CPU the tiled scan (XLA:CPU spreads ragged_dot over every expert), else ragged_dot.
    # The choice is made when lowering (lax.platform_dependent), so look at the CPU program:
    # no ragged_dot, a loop per grouped matmul (gate, up, down).
    assert jax.default_backend() == "cpu"
    cpu = fn.lower(lp0, jnp.asarray(h)).as_text()
    assert cpu.count("ragged_dot") == 0 and cpu.count("stablehlo.while") >= 3


def test_repos_is_exact_under_yarn():
    """Keys are stored with YaRN's attention factor (as transformers rotates them); the
    repos rotation by the unscaled table moves them to another position exactly."""
    cfg = load_model(tiny_dir("tiny_gpt_oss")).cfg
    s = cfg.rope.attention_scaling()
    assert s > 1.3
    rope = rope_table_for(cfg, 5000)
    k = jnp.asarray(np.random.default_rng(1).standard_normal((6, 2, cfg.head_dim)), jnp.float32)
    old = jnp.asarray([0, 5, 300, 1000, 4000, 17], jnp.int32)
    new = jnp.asarray([3000, 6, 2, 4999, 100, 17], jnp.int32)
    moved = rerotate(rope_scaled(k, old, rope, s), old, new, rope)
    np.testing.assert_allclose(moved, rope_scaled(k, new, rope, s), atol=3e-6)


def test_fixture_engine_reference_backend_matches_golden():
    """The serving engine with the jnp reference attention (the CPU run of the other test
    files uses the chunked path) reproduces transformers' 16 greedy tokens."""
    m = load_model(tiny_dir("tiny_gpt_oss"))
    g = tiny_golden("tiny_gpt_oss")
    out = engine_greedy(m, [g["prompt"].tolist()], 16, attention_backend="reference")
    assert out == [g["continuation"].tolist()]


def _engine_vs_causal(m, prompt: list[int], n: int) -> np.ndarray:
    """How far below the causal path's max logit each engine token is, along the engine's
    own continuation (0 where the engine picked the causal argmax)."""
    (out,) = engine_greedy(m, [prompt], n)
    logits, _ = greedy_generate(m.params, m.cfg, prompt + out[:-1], 1)
    rows = logits[len(prompt) - 1 :]
    return rows.max(-1) - rows[np.arange(len(out)), out]


def test_tiny_gpt_oss_model_causal_and_engine_agree():
    m = load_model("tiny-gpt-oss")
    assert m.source == "tiny-gpt-oss" and m.cfg.arch == "gpt_oss"
    assert m.tokenizer is not None and m.tokenizer.vocab_size == m.cfg.vocab_size
    # 48 = 3 pages: the engine's generated tokens follow the prompt with no padding slots.
    prompt = np.random.default_rng(2).integers(0, m.cfg.vocab_size - 1, 48).tolist()
    assert len(prompt) > m.cfg.sliding_window
    # A random model with std-0.02 weights has near-tied logits (top-2 gaps ~1e-4), so the
    # engine's tokens are checked against the causal logits, not token for token.
    assert np.all(_engine_vs_causal(m, prompt, 8) <= 1e-4)


def test_tiny_gpt_oss_engine_window_with_padded_prompt_page():
    """A 40-token prompt leaves its last page padded and generated tokens start on a fresh
    page: the window counts visible entries (DESIGN §2.1), so the padding does not shorten
    it, and decode matches the plain causal path."""
    m = load_model("tiny-gpt-oss")
    prompt = np.random.default_rng(2).integers(0, m.cfg.vocab_size - 1, 40).tolist()
    assert np.all(_engine_vs_causal(m, prompt, 8) <= 1e-4)


def test_gpt_oss_bfloat16_fixture_engine_first_tokens():
    """bf16 weights through the engine: the first greedy token matches transformers' float32
    argmax wherever the golden top-2 gap exceeds the bf16 bound (0.7, test_model_parity)."""
    m = load_model(tiny_dir("tiny_gpt_oss"), "bfloat16")
    g = tiny_golden("tiny_gpt_oss")
    top2 = np.sort(g["logits"], axis=-1)[:, -2:]
    lens = [int(i) + 1 for i in np.flatnonzero(top2[:, 1] - top2[:, 0] > 0.7)][:3]
    assert len(lens) == 3
    prompt = g["prompt"].tolist()
    out = engine_greedy(m, [prompt[:n] for n in lens], 1)
    assert [o[0] for o in out] == [int(g["logits"][n - 1].argmax()) for n in lens]


def test_converter_rejects_biases_for_a_model_without_them():
    from converters.mapping import ConversionError, hf_target

    cfg = load_model("tiny").cfg
    with pytest.raises(ConversionError, match="unexpected tensor"):
        hf_target("model.layers.0.self_attn.q_proj.bias", cfg)
    gcfg = dataclasses.replace(load_model(tiny_dir("tiny_gpt_oss")).cfg)
    tgt = hf_target("model.layers.1.mlp.experts.gate_up_proj", gcfg)
    assert [p for p, _ in tgt.outputs()] == ["layers.expert_gate", "layers.expert_up"]
    w = np.arange(2 * 3 * 4, dtype=np.float32).reshape(1, 2, 12)
    gate, up = (fn(w, gcfg) for _, fn in tgt.outputs())
    np.testing.assert_array_equal(gate, w[..., 0::2])
    np.testing.assert_array_equal(up, w[..., 1::2])
