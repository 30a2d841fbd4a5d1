"""Tensor parallelism on 8 host devices: sharded params give the unsharded logits.

Run in its own process (the device count is fixed when jax starts):

    pytest -m multidevice tests/test_sharding_multidevice.py
"""

from __future__ import annotations

import os
import sys

# Must precede the first jax import of this process (hence the module top). When another test
# module already imported jax (a whole-suite run, where this file is deselected), leave the
# flags alone so that process keeps its single host device.
_FLAG = "--xla_force_host_platform_device_count=8"
if "jax" not in sys.modules and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from golden import TINY, tiny_dir, tiny_golden  # noqa: E402

from akv_jax.model.causal import greedy_generate  # noqa: E402
from akv_jax.model.params import make_mesh, param_shardings, shard_params  # noqa: E402
from converters.loading import load_model  # noqa: E402

pytestmark = pytest.mark.multidevice

# Sharded and unsharded runs differ only in how XLA splits the matmul sums across devices.
SHARD_ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.fail(f"needs {_FLAG} before jax starts: run this file in its own process")


@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("name", TINY)
def test_tensor_parallel_logits_match_unsharded(name, tp):
    m = load_model(tiny_dir(name), "float32")
    g = tiny_golden(name)
    prompt = g["prompt"].tolist()
    ref_logits, ref_cont = greedy_generate(m.params, m.cfg, prompt, 4)

    mesh = make_mesh(tp)
    sharded = shard_params(m.params, m.cfg, mesh)
    # The mesh really splits what it can: with tp=2 every head/FFN axis divides, so q, k, v, o
    # and the MLP are all sharded; with tp=8 only the axes divisible by 8 are.
    shardings = param_shardings(m.cfg, mesh)
    n_split = sum(any(ax is not None for ax in s.spec) for s in jax.tree.leaves(shardings))
    if m.cfg.sigmoid_router:
        # MiniMax-M2: heads and the q/k norm weights (one per (head, dim): the norm over all
        # heads then reduces across the shards) split with tp=2; F = 20 splits over 2, not 8.
        if tp == 2:
            assert sharded.layers.q_norm.sharding.spec[1] == "tensor"
            assert sharded.layers.k_norm.sharding.spec[1] == "tensor"
            assert sharded.layers.expert_up.sharding.spec[3] == "tensor"
            assert n_split == 9  # wq wk wv wo q_norm k_norm + expert gate, up, down
        else:
            assert n_split == 0  # 4 q heads, 2 kv heads, F = 20: nothing divides 8
        assert len(sharded.layers.expert_up.addressable_shards) == 8
    elif m.cfg.arch == "qwen3_moe":
        # Qwen3-MoE: the experts (width 18) split over tp=2 inside, not over 8; the dense
        # layer's MLP (width 56) over both; no biases or sinks.
        lp = sharded.layers
        if tp == 2:
            assert lp.expert_gate.sharding.spec[3] == "tensor"
            assert lp.expert_down.sharding.spec[2] == "tensor"
            assert n_split == 10  # wq wk wv wo, w_gate w_up w_down, expert gate/up/down
        else:
            assert lp.expert_gate.sharding.spec[3] is None and n_split == 3
        assert lp.w_up.sharding.spec[2] == "tensor"
        assert all(ax is None for ax in lp.router.sharding.spec)
        assert len(lp.expert_up.addressable_shards) == 8
    elif m.cfg.is_moe:
        # GPT-OSS: experts are tensor-parallel inside (their width F = 28 splits over tp=2,
        # not 8); heads, head biases and sinks split like the weights.
        if tp == 2:
            assert sharded.layers.expert_up.sharding.spec[3] == "tensor"
            assert sharded.layers.expert_down.sharding.spec[2] == "tensor"
            assert sharded.layers.sinks.sharding.spec[1] == "tensor"
            # wq wk wv wo bq bk bv sinks + expert gate/up (weights, biases) and down
            assert n_split == 13
        assert len(sharded.layers.expert_up.addressable_shards) == 8
    else:
        if tp == 2:
            assert sharded.layers.wk.sharding.spec[2] == "tensor"  # kv heads split in two
            assert n_split == 7  # wq, wk, wv, wo, w_gate, w_up, w_down
        assert sharded.layers.w_up.sharding.spec[2] == "tensor"  # F = 80 / 88 divide 2 and 8
        assert len(sharded.layers.w_up.addressable_shards) == 8

    logits, cont = greedy_generate(sharded, m.cfg, prompt, 4)
    assert np.abs(logits - ref_logits).max() <= SHARD_ATOL
    assert cont == ref_cont
    # And still transformers' logits.
    assert np.abs(logits - g["logits"]).max() <= 1e-4
