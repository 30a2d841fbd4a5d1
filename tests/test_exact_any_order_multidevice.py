"""The request-order exactness protocol (exactness.py) with ``--tp 2`` on forced host
devices, on the tiny dense model. ``--disaggregate 2,2`` and the mixture-of-experts models
have their own files (a file is a unit of CI's test workers: the three together took ten
minutes on one).

Run in its own process (XLA_FLAGS must be set before jax is imported):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m multidevice tests/
"""

import pytest
from exactness import check_protocol, tiny_dense_model

pytestmark = pytest.mark.multidevice


def test_exact_in_any_order_at_tp2():
    """The server's default attention (the CPU kernel per head shard), and each answer bit
    for bit against the request alone at tp 2."""
    check_protocol(tiny_dense_model(), {"tp": 2}, num_requests=24, history_seed=1,
                   order_seed=7, host_tier=True, bitwise=True, backend="auto")
