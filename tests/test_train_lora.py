"""LoRA adapters: applied unmerged (low-rank path in the forward) equals merged into the
weights; a fresh adapter is the base model; only adapters get gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from akv_jax.cache.ops import parse_history
from akv_jax.kernels.projection import Adapted
from akv_jax.model.params import seeded_params
from akv_jax.model.presets import tiny_config
from akv_jax.train.example import TrainTrajectory
from akv_jax.train.lora import TARGETS, adapt, init_lora, merge
from akv_jax.train.loss import loss, pack_logits
from akv_jax.train.pack import PackShape, pack

SHAPE = PackShape(max_tokens=64, page_size=8, block_q=8, max_segments=8, max_trajectories=2)


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    params = seeded_params(cfg, 0)
    rng = np.random.default_rng(0)
    lens = [7, 5, 9]
    segs = [rng.integers(0, 512, n).tolist() for n in lens]
    h = parse_history({"drop": {"1": [0]}, "reposition": [1]}, 3)
    ex = pack([TrainTrajectory(segs, h, [np.ones(n, bool) for n in lens])], SHAPE)
    logits = jax.jit(lambda p, ex: pack_logits(p, cfg, ex, SHAPE))
    return cfg, params, ex, logits


def test_merged_equals_unmerged(setup):
    cfg, params, ex, logits = setup
    lora = init_lora(params, rank=4, alpha=8.0, seed=1, b_std=0.05)
    assert set(lora.pairs()) == set(TARGETS) and lora.rank == 4 and lora.scale == 2.0
    unmerged = adapt(params, lora)
    assert isinstance(unmerged.layers.wo, Adapted)
    merged = merge(params, lora)
    # the merged weight is W + scale * a @ b, computed here by hand for one layer of wo
    a, b = np.asarray(lora.wo.a[1]), np.asarray(lora.wo.b[1])
    want = np.asarray(params.layers.wo[1]) + 2.0 * np.einsum("hkr,rd->hkd", a, b)
    np.testing.assert_allclose(np.asarray(merged.layers.wo[1]), want, atol=1e-6)
    base = np.asarray(logits(params, ex))
    got_u = np.asarray(logits(unmerged, ex))
    got_m = np.asarray(logits(merged, ex))
    np.testing.assert_allclose(got_u, got_m, atol=1e-5, rtol=0)
    assert np.abs(got_u - base).max() > 1e-2  # the adapters do change the model


def test_fresh_adapter_is_the_base_model(setup):
    cfg, params, ex, logits = setup
    lora = init_lora(params, rank=2, targets=("wq", "w_down"))
    assert set(lora.pairs()) == {"wq", "w_down"} and not lora.wq.b.any()
    np.testing.assert_array_equal(
        np.asarray(logits(merge(params, lora), ex)), np.asarray(logits(params, ex))
    )
    np.testing.assert_allclose(
        np.asarray(logits(adapt(params, lora), ex)),
        np.asarray(logits(params, ex)),
        atol=1e-6,
        rtol=0,
    )


def test_gradients_reach_the_adapters_only(setup):
    cfg, params, ex, _ = setup
    lora = init_lora(params, rank=2, seed=3, b_std=0.02)
    g = jax.jit(jax.grad(lambda lo: loss(adapt(params, lo), cfg, ex, SHAPE)))(lora)
    assert jax.tree.structure(g) == jax.tree.structure(lora)
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g))
    # d loss / d b equals d loss / d W contracted with scale * a (chain rule through merge)
    gw = jax.jit(jax.grad(lambda p: loss(p, cfg, ex, SHAPE)))(merge(params, lora))
    want = lora.scale * jnp.einsum("ldr,ldf->lrf", lora.w_up.a, gw.layers.w_up)
    np.testing.assert_allclose(np.asarray(g.w_up.b), np.asarray(want), atol=1e-6, rtol=1e-4)


def test_bad_targets_name_the_field(setup):
    _, params, _, _ = setup
    with pytest.raises(ValueError, match="unknown LoRA target 'w_q'"):
        init_lora(params, rank=2, targets=("w_q",))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        init_lora(params, rank=0)
