"""A request's answer depends on the request alone (DESIGN.md §2), whatever order requests
come in and whatever the server holds, on every attention backend: the harness in
exactness.py, against the dense reference. The multidevice process runs the same protocol
with ``--tp 2`` and ``--disaggregate 2,2`` and on the mixture-of-experts models
(test_exact_any_order_*multidevice.py)."""


import numpy as np
import pytest
from exactness import (
    N_NEW,
    dense_answers,
    exact_in_any_order,
    mismatches,
    random_histories,
    reference_answer,
    run_requests,
    tiny_dense_model,
)

from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import parse_history
from akv_jax.kernels.cpu import matmul as cpu_matmul
from akv_jax.serving.engine import Engine
from akv_jax.serving.executor import PREFILL_BLOCK_Q, token_bucket
from akv_jax.serving.types import GenerateRequest, SamplingParams

NUM_REQUESTS = 24


@pytest.fixture(scope="module")
def setup():
    model = tiny_dense_model()
    dm = DenseModel(model.params, model.cfg)
    reqs = random_histories(np.random.default_rng(1), NUM_REQUESTS, vocab=model.cfg.vocab_size,
                            answer=reference_answer(dm))
    return model, reqs, dense_answers(dm, reqs)


# Interpret mode runs the Pallas kernel's grid in Python: 164 s for the first 6 requests of
# the set (extensions included: they only extend earlier ones), the longest test of the
# suite, so both Pallas cases are slow-marked (-m slow); on every CI run the kernel is
# checked against the reference per call (test_pallas_attention.py) and through the serving
# path (test_engine_exact.py::test_pallas_backend_through_serving_path). "auto" is the fused
# C++ kernel on the CPU. Prefill in 7-row slices (cuts inside segments, at repos writes,
# across restores) is slow-marked too: test_engine_exact covers slices on every CI run. So is
# the reference backend here (3.5 minutes, the suite's longest case): CI runs the protocol
# with it for the MoE models at --tp 2 (test_exact_any_order_moe_multidevice.py), and here
# on "auto", the CPU's serving path, host tier included.
@pytest.mark.parametrize(
    "backend, chunk, count",
    [
        pytest.param("reference", 4096, NUM_REQUESTS, marks=pytest.mark.slow),
        ("auto", 4096, NUM_REQUESTS),
        pytest.param("pallas", 4096, 6, marks=pytest.mark.slow),
        pytest.param("pallas", 4096, NUM_REQUESTS, marks=pytest.mark.slow),
        pytest.param("reference", 7, NUM_REQUESTS, marks=pytest.mark.slow),
    ],
    ids=["reference", "auto", "pallas-interpret", "pallas-interpret-all",
         "reference-prefill-slices"],
)
def test_exact_in_any_order(setup, backend, chunk, count):
    model, reqs, refs = setup
    reqs, refs = reqs[:count], refs[:count]

    def make_engine(**kw):
        return Engine(model, attention_backend=backend, prefill_chunk=chunk, **kw)

    # "auto" runs every CPU kernel: the fused attention, the few-row matmul for decode rows
    # and the GEMM for every prefill forward (from the smallest prefill bucket up).
    assert cpu_matmul.MIN_GEMM_ROWS <= token_bucket(1, PREFILL_BLOCK_Q)
    host_tier = backend == "auto"  # the tier moves bytes: one backend covers it
    # Bit for bit against each request alone (DESIGN §4.1), on every backend.
    stats = exact_in_any_order(make_engine, model, reqs, refs, seed=7, host_tier=host_tier,
                               bitwise=True)
    # The small pool really evicted and restored, dead KV first.
    assert stats["evictions"] > 0 and stats["dead_evictions"] > 0
    assert stats["restores"] > 0
    if not host_tier:
        return
    # With a host tier: live KV spilled and reloaded (preemption: test_engine_exact); the
    # small tier also evicted host copies, so restores recomputed what it had lost.
    assert stats["offloaded_pages[all]"] > 0 and stats["reloaded_pages[all]"] > 0
    assert stats["host_evicted_pages[all]"] == 0
    assert stats["host_evicted_pages[a quarter]"] > 0 and stats["restores[a quarter]"] > 0


def test_a_request_after_its_extension_keeps_its_view_under_eviction(setup):
    """The bug the random protocol found (issue 12): a request whose path ends inside the
    stored path of its own extension, which drops one of its segments. That segment's KV is
    dead for every *stored* path below, but the running request still attends to it: it
    must not be evicted while the request decodes (a pool with no spare page makes its
    first decode allocation evict)."""
    model = setup[0]
    base = ([list(range(1, 9)), list(range(10, 18)), list(range(20, 28))],
            {"drop": {}, "reposition": []})
    ext = (base[0] + [list(range(30, 38))], {"drop": {"3": [1]}, "reposition": []})
    reqs = [base, ext]
    refs = dense_answers(DenseModel(model.params, model.cfg), reqs, 8)
    eng = Engine(model, max_total_tokens=8 * 5, page_size=8, attention_backend="reference")
    assert eng.num_pages == 5  # the extension and its 7 cached answer tokens fill it
    run_requests(eng, reqs, [1], False, 8)
    got = run_requests(eng, reqs, [0], False, 8)
    assert mismatches(refs, [0], got) == []
    assert eng.cache.tree.evictions > 0  # the decode allocation did evict (a live node, not the
    assert eng.flush_cache() and eng.cache.pool.used_pages == 0  # base's segment 1)


def test_a_prefix_stored_in_too_many_pages_fails_clearly(setup):
    """check() bounds a request's pages by its own segments; a prefix stored split at other
    requests' message boundaries can need more. Such a request fails with a message that
    says so, instead of being cut short when its decode finds no page."""
    model = setup[0]
    t = list(range(1, 41))
    split = ([t[:5], t[5:10], t[10:15]], {"drop": {}, "reposition": []})
    whole = ([t[:16]], {"drop": {}, "reposition": []})
    eng = Engine(model, max_total_tokens=16 * 4, page_size=16, attention_backend="reference")
    (first,) = run_requests(eng, [split, whole], [0], False)
    assert first[2]["finish_reason"] == "length"
    events = []
    eng.add_request(GenerateRequest("w", whole[0], parse_history(None, 1),
                                    SamplingParams(max_new_tokens=N_NEW), True))
    while eng.has_work():
        events += eng.step()
    (ev,) = events
    assert ev.finish_reason == "error" and "raise --max-total-tokens" in ev.error
    assert eng.flush_cache() and eng.cache.pool.used_pages == 0
    # On a fresh engine of the same size the same request is exact.
    fresh = Engine(model, max_total_tokens=16 * 4, page_size=16, attention_backend="reference")
    refs = dense_answers(DenseModel(model.params, model.cfg), [whole])
    assert mismatches(refs, [0], run_requests(fresh, [whole], [0], False)) == []
