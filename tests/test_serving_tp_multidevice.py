"""Tensor-parallel serving on 8 forced host devices: identical tokens and log-probs.

Run in its own process (XLA_FLAGS must be set before jax is imported):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest -m multidevice tests/
"""

# XLA_FLAGS is set by scripts/test.sh for that process only: setting it here at import time
# would also give the main test process (which collects this module) eight devices.
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from engine_cases import check, random_requests, run

from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import parse_history
from akv_jax.cache.timeline import timeline
from akv_jax.model.config import ModelConfig, RopeConfig
from akv_jax.model.params import seeded_params
from akv_jax.serving.admission import pages_bound
from akv_jax.serving.engine import Engine

pytestmark = pytest.mark.multidevice

# kv heads 8 and q heads 16 so that every tp in (1, 2, 4, 8) really shards the KV pool.
CFG = ModelConfig(
    arch="llama",
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=16,
    num_kv_heads=8,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=10000.0),
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def test_tp_degrees_agree():
    """/generate-equivalent engine runs on random op histories at tp 1, 2, 4, 8."""
    if jax.device_count() < 8:
        pytest.fail("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (own process)")
    model = SimpleNamespace(cfg=CFG, params=seeded_params(CFG, 5), tokenizer=None)
    reqs = random_requests(np.random.default_rng(5), 8, vocab=CFG.vocab_size)
    results = {}
    for tp in (1, 2, 4, 8):
        eng = Engine(
            model, max_total_tokens=2048, page_size=8, attention_backend="reference", tp=tp
        )
        if tp > 1:
            spec = eng.executor.prefill.kv.k.sharding.spec
            assert spec[3] == "tensor", spec  # the KV pool really is split over kv heads
        results[tp] = run(eng, reqs, concurrent=True)
    dm = DenseModel(model.params, CFG)
    check(dm, reqs, results[1])
    for tp in (2, 4, 8):
        assert [r[0] for r in results[tp]] == [r[0] for r in results[1]], tp
        for a, b in zip(results[tp], results[1], strict=True):
            np.testing.assert_allclose(a[1], b[1], atol=1e-4)


def test_disaggregated_matches_colocated():
    """--disaggregate 4,4: prefill (and restores) on devices 0-3, decode on 4-7, KV pages
    handed over; the same tokens and log-probs as colocated serving, also under eviction."""
    if jax.device_count() < 8:
        pytest.fail("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (own process)")
    model = SimpleNamespace(cfg=CFG, params=seeded_params(CFG, 6), tokenizer=None)
    reqs = random_requests(np.random.default_rng(6), 12, vocab=CFG.vocab_size)
    colo = Engine(model, max_total_tokens=2048, page_size=8, attention_backend="reference")
    want = run(colo, reqs, concurrent=True)
    need = max(
        pages_bound(
            timeline([len(x) for x in segs], parse_history(c, len(segs))),
            4,
            parse_history(c, len(segs)),
            8,
        )
        for segs, c in reqs
    )
    small = 8 * need  # a pool that holds just the largest request: evictions and restores
    for tokens in (2048, small):
        dis = Engine(
            model,
            max_total_tokens=tokens,
            page_size=8,
            attention_backend="reference",
            disaggregate=(4, 4),
            host_kv_tokens=0,  # evicted live KV recomputed (the host tier: exactness.py)
        )
        assert dis.executor.prefill is not dis.executor.decode
        prefill_devs = {d.id for d in dis.executor.prefill.kv.k.devices()}
        decode_devs = {d.id for d in dis.executor.decode.kv.k.devices()}
        assert prefill_devs == {0, 1, 2, 3} and decode_devs == {4, 5, 6, 7}
        got = run(dis, reqs, concurrent=tokens != small)
        if tokens == small:
            assert dis.cache.tree.evictions > 0 and dis.counters["restores"] > 0
        assert [g[0] for g in got] == [w[0] for w in want]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a[1], b[1], atol=1e-4)


def test_pallas_kernel_runs_per_head_shard_at_tp2():
    """The Pallas attention under tensor parallelism runs once per head shard (shard_map
    over the serving step's mesh: a Mosaic call cannot be partitioned by GSPMD, see
    dispatch._per_head_shard); here the kernel body runs interpreted on the CPU, and tp=2
    gives tp=1's tokens and log-probs."""
    if jax.device_count() < 8:
        pytest.fail("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (own process)")
    model = SimpleNamespace(cfg=CFG, params=seeded_params(CFG, 7), tokenizer=None)
    reqs = random_requests(np.random.default_rng(7), 3, vocab=CFG.vocab_size)
    results = {}
    for tp in (1, 2):
        eng = Engine(model, max_total_tokens=1024, page_size=8, attention_backend="pallas", tp=tp)
        results[tp] = run(eng, reqs, concurrent=True)
    assert [r[0] for r in results[2]] == [r[0] for r in results[1]]
    for a, b in zip(results[2], results[1], strict=True):
        np.testing.assert_allclose(a[1], b[1], atol=1e-4)
