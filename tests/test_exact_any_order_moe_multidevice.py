"""The request-order exactness protocol (exactness.py) on each random mixture-of-experts
model with ``--tp 2`` (and, slow-marked, ``--disaggregate 2,2``) on forced host devices.

Run in its own process (XLA_FLAGS must be set before jax is imported):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m multidevice tests/
"""

import pytest
from exactness import check_protocol

from converters.loading import load_model

pytestmark = pytest.mark.multidevice

# Each model with a smaller request set (the fewest, with these seeds, that still evict and
# restore): (model, requests, seed).
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
    name, count, seed = MOE_MODELS[family]
    check_protocol(load_model(name), topology, num_requests=count, history_seed=seed,
                   order_seed=seed)
