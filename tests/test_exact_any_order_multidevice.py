"""The request-order exactness protocol (exactness.py) with ``--tp 2`` and with
``--disaggregate 2,2`` on forced host devices.

Run in its own process (XLA_FLAGS must be set before jax is imported):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m multidevice tests/
"""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from exactness import dense_answers, exact_in_any_order, random_histories, reference_answer

from akv_jax.cache.dense_reference import DenseModel
from akv_jax.model.config import tiny_config
from akv_jax.model.params import init_params
from akv_jax.serving.engine import Engine
from converters.loading import load_model

pytestmark = pytest.mark.multidevice


@pytest.mark.parametrize("topology", [{"tp": 2}, {"disaggregate": (2, 2)}],
                         ids=["tp2", "disaggregate-2-2"])
def test_exact_in_any_order_multidevice(topology):
    if jax.device_count() < 4:
        pytest.fail("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (own process)")
    cfg = tiny_config("qwen3")
    params = init_params(cfg, jax.random.key(1))
    _check_protocol(SimpleNamespace(cfg=cfg, params=params, tokenizer=None), topology,
                    num_requests=24, history_seed=1, order_seed=7, host_tier=True)


# The random mixture-of-experts models, each with a smaller request set (the fewest, with
# these seeds, that still evict and restore): (model, requests, seed).
MOE_MODELS = {
    "gpt_oss": ("tiny-gpt-oss", 8, 14),  # sinks, window 8, YaRN, biased top-k router
    # partial rotary, q/k norm over all heads (a cross-shard reduction at tp 2), sigmoid router
    "minimax_m2": ("tiny-minimax-m2", 6, 16),
    "qwen3_moe": ("tiny-qwen3-moe", 6, 16),  # dense and MoE layers, softmax router, q/k norms
}


@pytest.mark.parametrize("topology", [
    {"tp": 2},
    # 1-4.5 min each on this machine's two cores: out of CI (-m "multidevice and slow")
    pytest.param({"disaggregate": (2, 2)}, marks=pytest.mark.slow),
], ids=["tp2", "disaggregate-2-2"])
@pytest.mark.parametrize("family", list(MOE_MODELS))
def test_moe_model_exact_in_any_order_multidevice(family, topology):
    """Each random MoE model through the same protocol, against the dense reference."""
    if jax.device_count() < 4:
        pytest.fail("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (own process)")
    name, count, seed = MOE_MODELS[family]
    _check_protocol(load_model(name), topology,
                    num_requests=count, history_seed=seed, order_seed=seed)


def _check_protocol(model, topology: dict, num_requests: int, history_seed: int,
                    order_seed: int, host_tier: bool = False) -> None:
    """Random histories through exact_in_any_order on ``topology``, against the dense
    reference; the small pool must really evict and restore. ``host_tier``: with the host
    tier's phases (once per topology: the tier moves bytes, whatever the model)."""
    dm = DenseModel(model.params, model.cfg)
    reqs = random_histories(np.random.default_rng(history_seed), num_requests,
                            vocab=model.cfg.vocab_size, answer=reference_answer(dm))
    refs = dense_answers(dm, reqs)

    def make_engine(**kw):
        return Engine(model, attention_backend="reference", **topology, **kw)

    stats = exact_in_any_order(make_engine, model, reqs, refs, seed=order_seed,
                               host_tier=host_tier)
    assert stats["evictions"] > 0 and stats["restores"] > 0
    if host_tier:  # under tensor parallelism / disaggregation: spilled and reloaded
        assert stats["offloaded_pages[all]"] > 0 and stats["reloaded_pages[all]"] > 0
