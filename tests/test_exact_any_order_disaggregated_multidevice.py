"""The request-order exactness protocol (exactness.py) with ``--disaggregate 2,2`` (prefill
on two forced host devices, decode on two others, KV copied between them) on the tiny dense
model.

Run in its own process (XLA_FLAGS must be set before jax is imported):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m multidevice tests/
"""

import pytest
from exactness import check_protocol, tiny_dense_model

pytestmark = pytest.mark.multidevice


def test_exact_in_any_order_disaggregated():
    """The server's default attention, and each answer bit for bit against the request alone
    on the same two groups."""
    check_protocol(tiny_dense_model(), {"disaggregate": (2, 2)}, num_requests=24,
                   history_seed=1, order_seed=7, host_tier=True, bitwise=True, backend="auto")
