"""The serving engine against the naive dense reference: tokens and float32 log-probs.

Random op histories (drops of middle and first segments, repos, multi-turn extensions of
earlier requests) run serially, concurrently, after a flush, and through a pool so small
that most state is evicted and restored between requests.
"""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from engine_cases import N_NEW, check, random_requests, run
from exactness import dense_greedy as dense_generate
from exactness import pool_that_forces_eviction, run_requests

from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import parse_history
from akv_jax.errors import InvalidField
from akv_jax.model.params import init_params
from akv_jax.model.presets import tiny_config
from akv_jax.serving.engine import Engine
from akv_jax.serving.types import GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("qwen3")
    params = init_params(cfg, jax.random.key(3))
    return SimpleNamespace(cfg=cfg, params=params, tokenizer=None), DenseModel(params, cfg)


def smallest_engine(m, reqs, **kw) -> Engine:
    """An engine (page size 8) whose pool holds just the largest of ``reqs``."""
    tokens = pool_that_forces_eviction(reqs, 8, 1, N_NEW)
    kw.setdefault("host_kv_tokens", 0)  # evicted live KV is recomputed (restores)
    return Engine(m, max_total_tokens=tokens, page_size=8, attention_backend="reference", **kw)


def test_serial_concurrent_flush_and_tiny_pool(model):
    m, dm = model
    reqs = random_requests(np.random.default_rng(11), 50)
    eng = Engine(m, max_total_tokens=4096, page_size=8, attention_backend="reference")
    serial = run(eng, reqs, concurrent=False)
    check(dm, reqs, serial)
    assert eng.counters["cache_hit_tokens"] > 0  # extensions reused earlier turns
    concurrent = run(eng, reqs, concurrent=True)
    assert [r[0] for r in concurrent] == [r[0] for r in serial]
    check(dm, reqs, concurrent)
    assert eng.flush_cache()
    assert eng.cache.pool.used_pages == 0  # no page leaks
    check(dm, reqs, run(eng, reqs, concurrent=True))
    # A pool that holds just the largest request: most state is evicted and restored.
    small = smallest_engine(m, reqs)
    check(dm, reqs, run(small, reqs, concurrent=False))
    assert small.cache.tree.evictions > 0
    assert small.cache.tree.dead_evictions > 0  # dropped / superseded KV went first
    assert small.counters["restores"] > 0
    assert small.flush_cache() and small.cache.pool.used_pages == 0


def test_dead_kv_is_evicted_not_recomputed(model):
    """A rolling drop's dead KV is freed without hurting the next turn: nothing recomputes it,
    it counts as cached, and the answer still equals the dense reference."""
    m, dm = model
    segs = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16], [17, 18, 19]]
    cache = {"drop": {"2": [1]}, "reposition": []}
    eng = Engine(m, max_total_tokens=1024, page_size=4, attention_backend="reference")
    check(dm, [(segs, cache)], run(eng, [(segs, cache)], concurrent=False))
    dead = eng.cache.tree.dead()
    assert dead  # segment 1's node: every stored path below drops it
    assert {n.token_ids() for n in eng.cache.tree.nodes() if n.id in dead} == {tuple(range(7, 16))}
    freed = eng.cache.tree.evict(len([n for n in eng.cache.tree.nodes() if n.id in dead][0].pages))
    assert freed == eng.cache.tree.dead_evictions == 3  # nothing live went
    nxt = (segs + [[20, 21, 22, 23, 24]], cache)
    (result,) = run(eng, [nxt], concurrent=False)
    check(dm, [nxt], [result])
    assert result[2]["cached_tokens"] == 19  # all but the new segment: reused or dead
    assert eng.counters["restores"] == 0


def test_isolation_shared_prefix_different_ops(model):
    m, dm = model
    base = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14, 15]]
    caches = [
        {"drop": {}, "reposition": []},
        {"drop": {"2": [1]}, "reposition": []},
        {"drop": {"2": [1]}, "reposition": [2]},
        {"drop": {"3": [0, 2]}, "reposition": [3]},
    ]
    reqs = [(base, c) for c in caches]
    eng = Engine(m, max_total_tokens=2048, page_size=4, attention_backend="reference")
    solo = [run(eng, [r], concurrent=False)[0] for r in reqs]
    eng.flush_cache()
    together = run(eng, reqs, concurrent=True)
    assert [t[0] for t in together] == [s[0] for s in solo]
    for a, b in zip(together, solo, strict=True):
        np.testing.assert_allclose(a[1], b[1], atol=1e-5)
    check(dm, reqs, together)
    assert len({tuple(t[0]) for t in together}) > 1  # the ops really change the outputs


def test_engine_rejects_bad_requests(model):
    m, _ = model
    eng = Engine(m, max_total_tokens=256, page_size=8, attention_backend="reference")
    bad = [
        ([[1, 2], [600]], None, "input_ids[1][0]"),
        ([[1, 2], []], None, "input_ids[1]"),
        ([list(range(1, 300))], None, "input_ids"),  # more pages than the pool holds
    ]
    for segs, cache, field in bad:
        with pytest.raises(InvalidField) as e:
            eng.check(GenerateRequest("x", segs, parse_history(cache, len(segs))))
        assert e.value.field == field
    big = Engine(m, max_total_tokens=8192, page_size=8, attention_backend="reference")
    segs = [[1] * 2000, [2] * 2000, [3] * 100]
    with pytest.raises(InvalidField) as e:
        big.check(
            GenerateRequest("x", segs, parse_history(None, 3), SamplingParams(max_new_tokens=4))
        )
    assert "add a reposition" in str(e.value)
    ok = parse_history({"drop": {"1": [0, 1]}, "reposition": [1]}, 3)
    big.check(GenerateRequest("y", segs, ok, SamplingParams(max_new_tokens=4)))


def test_pallas_backend_through_serving_path(model):
    """The engine with the Pallas kernels (interpret mode on the CPU) gives the reference's
    tokens and log-probs on op histories with drops and repositions."""
    m, dm = model
    reqs = [
        (
            [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]],
            {"drop": {"2": [1]}, "reposition": [2]},
        ),
        ([[1, 2, 3, 4, 5, 6], [7, 8, 9], [14, 15]], {"drop": {"1": [0]}, "reposition": []}),
    ]
    eng = Engine(m, max_total_tokens=512, page_size=8, attention_backend="pallas")
    got = run(eng, reqs, concurrent=True)
    check(dm, reqs, got)


def test_chunked_prefill_matches_reference(model):
    """Passes cut into 3-row slices (cuts inside segments, at repos writes, across restores),
    many requests at once: the same tokens and log-probs as the dense reference."""
    m, dm = model
    reqs = random_requests(np.random.default_rng(5), 24)
    eng = Engine(m, max_total_tokens=4096, page_size=8, attention_backend="reference",
                 prefill_chunk=3)
    check(dm, reqs, run(eng, reqs, concurrent=True))
    small = smallest_engine(m, reqs, prefill_chunk=3)
    check(dm, reqs, run(small, reqs, concurrent=False))
    assert small.counters["restores"] > 0
    assert small.flush_cache() and small.cache.pool.used_pages == 0


def _add(eng, rid, segs, cache=None, n=N_NEW):
    h = parse_history(cache, len(segs))
    eng.add_request(GenerateRequest(rid, segs, h, SamplingParams(max_new_tokens=n), True))


def test_decode_runs_while_a_long_prompt_prefills(model):
    """A 200-token prompt prefills 32 rows per step; the running request gets a token every
    one of those steps instead of waiting for the whole prompt."""
    m, dm = model
    eng = Engine(m, max_total_tokens=2048, page_size=8, attention_backend="reference",
                 prefill_chunk=32)
    short = [[1, 2, 3, 4, 5]]
    long = [list(range(10, 110)), list(range(110, 210))]
    _add(eng, "a", short, n=12)
    got: dict[str, list] = {"a": [], "b": []}
    for ev in eng.step():
        got[ev.rid].append(ev)
    _add(eng, "b", long, n=3)
    steps_before_b = 0
    while not got["b"]:
        events = eng.step()
        for ev in events:
            got[ev.rid].append(ev)
        steps_before_b += 1
        if not got["b"] and steps_before_b > 1:  # the first step's token is read a step late
            assert any(ev.rid == "a" for ev in events)  # decode did not wait
    assert steps_before_b == -(-200 // 32)
    while eng.has_work():
        for ev in eng.step():
            got[ev.rid].append(ev)
    for rid, segs, n in (("a", short, 12), ("b", long, 3)):
        ref_toks, ref_lps = dense_generate(dm, segs, parse_history(None, len(segs)), n)
        assert [ev.token_id for ev in got[rid]] == ref_toks
        np.testing.assert_allclose([ev.logprob for ev in got[rid]], ref_lps, atol=1e-4)


def test_abort_mid_prefill_leaves_no_half_written_kv(model):
    """Aborted after two of its slices, a request's nodes go back to evicted: the same prompt
    (and one extending it) sent again is recomputed and matches the reference; no page leaks."""
    m, dm = model
    eng = Engine(m, max_total_tokens=2048, page_size=8, attention_backend="reference",
                 prefill_chunk=16)
    segs = [list(range(1, 41)), list(range(41, 81))]
    cache = {"drop": {"1": [0]}, "reposition": [1]}
    _add(eng, "x", segs, cache)
    assert eng.step() == [] and eng.step() == []
    assert "x" in eng.prefilling
    # A request sharing the prefix may not be planned on KV that is not written yet.
    _add(eng, "y", segs + [[90, 91]], cache)
    y = eng.waiting.popleft()
    assert eng.planner.plan(y, eng.step_id) is None
    eng.abort("x")
    assert not eng.has_work()
    assert all(n.writer is None for n in eng.cache.tree.nodes())
    reqs = [(segs, cache), (segs + [[90, 91, 92]], cache)]
    check(dm, reqs, run(eng, reqs, concurrent=True))
    assert eng.flush_cache() and eng.cache.pool.used_pages == 0


def test_warm_up_shapes_covers_the_steps_and_leaves_no_trace(model):
    """After warm_up_shapes, requests of any length up to the chunk (decoding beside each
    other) compile nothing new, and the dummy forwards left no KV or tree state behind."""
    from akv_jax.serving.device_group import forward_step

    m, dm = model
    eng = Engine(m, max_total_tokens=2048, page_size=8, attention_backend="reference",
                 prefill_chunk=128, max_running=8)
    # 4,096 positions = one view bucket (512 pages); prefill T 64 and 128, each with one
    # segment and with several; decode 1, 4 and 8 rows
    assert eng.warm_up_shapes() == 7
    assert eng.cache.pool.used_pages == 0 and not list(eng.cache.tree.root.children)
    compiled = forward_step._cache_size()
    reqs = [([list(range(1, 1 + n))], {"drop": {}, "reposition": []}) for n in (5, 70, 200)]
    reqs.append(([list(range(1, 40)), list(range(40, 90))], {"drop": {}, "reposition": []}))
    check(dm, reqs, run(eng, reqs, concurrent=True))
    assert forward_step._cache_size() == compiled


# Both tiers run in the any-order harness on every CI run (test_exact_any_order.py, "auto"),
# and prefill slices in test_chunked_prefill_matches_reference: slow-marked here (a minute
# each), where they meet.
@pytest.mark.parametrize("host, chunk", [
    pytest.param("all", 3, marks=pytest.mark.slow),
    pytest.param("a quarter", 4096, marks=pytest.mark.slow)])
def test_host_tier_round_trips_are_exact(model, host, chunk):
    """A device pool that holds just the largest request and a host tier that holds the rest
    (every evicted live page is spilled, and reloaded when read again; prefill in 3-row
    slices) or a quarter of it (host copies are evicted in turn; what is lost is
    recomputed): answers equal the dense reference; nothing leaks in either tier."""
    m, dm = model
    reqs = random_requests(np.random.default_rng(12), 24)
    tokens = pool_that_forces_eviction(reqs, 8, 1, N_NEW)
    host_tokens = 64 * tokens if host == "all" else tokens // 4
    eng = smallest_engine(m, reqs, host_kv_tokens=host_tokens, prefill_chunk=chunk)
    check(dm, reqs, run(eng, reqs, concurrent=True))
    check(dm, reqs, run(eng, reqs[::-1], concurrent=False)[::-1])
    st = eng.stats()
    assert st["offloaded_pages"] > 0 and st["reloaded_pages"] > 0
    if host == "all":
        assert st["host_evicted_pages"] == 0
    else:
        assert st["host_evicted_pages"] > 0 and st["restores"] > 0
    assert eng.flush_cache() and eng.cache.pool.used_pages == 0
    assert eng.cache.host_used_pages == 0


@pytest.mark.parametrize("host_tokens", [4096, 0])
def test_preempted_requests_resume_exactly(model, host_tokens):
    """Four requests decode 40 tokens each in a pool that holds about two of them: decodes
    run out of pages, the youngest are preempted (their KV spilled to the host tier, or,
    without one, recomputed on resume) and resumed, sampling nothing twice and losing no
    token; every answer equals the dense reference's."""
    m, dm = model
    rng = np.random.default_rng(3)
    reqs = [([rng.integers(0, 256, 20).tolist(), rng.integers(0, 256, 12).tolist()],
             {"drop": {}, "reposition": []}) for _ in range(4)]
    n_new = 40
    eng = Engine(m, max_total_tokens=8 * 20, page_size=8, attention_backend="reference",
                 host_kv_tokens=host_tokens)
    got = run_requests(eng, reqs, list(range(4)), True, n=n_new)
    for (segs, cache), (toks, lps, meta) in zip(reqs, got, strict=True):
        ref_toks, ref_lps = dense_generate(dm, segs, parse_history(cache, len(segs)), n_new)
        assert toks == ref_toks and meta["finish_reason"] == "length"
        np.testing.assert_allclose(lps, ref_lps, atol=1e-4)
        assert meta["prompt_tokens"] == 32 and meta["completion_tokens"] == n_new
    st = eng.stats()
    assert st["preemptions"] > 0 and st["resumes"] == st["preemptions"]
    if host_tokens:
        assert st["reloaded_pages"] > 0
    assert eng.flush_cache() and eng.cache.pool.used_pages == 0


@pytest.mark.parametrize("window", [1000.0, 0.0])
def test_admission_waits_rather_than_lose_an_active_trajectorys_kv(model, window):
    """No host tier; trajectory A has just finished a turn (its KV unlocked but used a moment
    ago), B decodes, and C's prefill fits only by evicting A's KV. With a protection window C
    waits (admission_waits counts the steps) until nothing else runs; without one it evicts
    A at once and runs beside B. Either way every answer equals the reference."""
    m, dm = model
    rng = np.random.default_rng(4)
    a, b, c = ([rng.integers(0, 256, 32).tolist()] for _ in range(3))
    eng = Engine(m, max_total_tokens=8 * 12, page_size=8, attention_backend="reference",
                 host_kv_tokens=0, admission_window_s=window, admission_max_wait_s=1000.0)
    order: list[tuple[str, bool]] = []  # (rid, finished) in event order
    got: dict[str, list] = {"a": [], "b": [], "c": []}

    def step():
        for ev in eng.step():
            got[ev.rid].append(ev)
            order.append((ev.rid, ev.finished))

    _add(eng, "a", [a[0]], n=8)
    while eng.has_work():
        step()
    _add(eng, "b", [b[0]], n=40)
    step()
    _add(eng, "c", [c[0]], n=8)
    while eng.has_work():
        step()
    first_c = order.index(("c", False))
    b_done = order.index(("b", True))
    if window:
        assert first_c > b_done and eng.counters["admission_waits"] > 0
    else:
        assert first_c < b_done and eng.counters["admission_waits"] == 0
    for rid, segs, n in (("a", [a[0]], 8), ("b", [b[0]], 40), ("c", [c[0]], 8)):
        ref_toks, ref_lps = dense_generate(dm, segs, parse_history(None, len(segs)), n)
        assert [ev.token_id for ev in got[rid] if ev.token_id >= 0] == ref_toks


def test_sliced_pass_frees_dead_kv_once_the_rows_that_read_it_have_run(model):
    """Segments A B C D, B dropped after C: C's rows read B, D's do not. With one segment
    per slice, B stays pinned until C's slice has run, then (dead: nothing stored below
    attends to it, the request's final view included) eviction may free it while D's slice
    is still to come; the answer is still the reference's."""
    m, dm = model
    rng = np.random.default_rng(9)
    segs = [rng.integers(0, 256, 16).tolist() for _ in range(4)]
    cache = {"drop": {"2": [1]}, "reposition": []}
    eng = Engine(m, max_total_tokens=1024, page_size=8, attention_backend="reference",
                 prefill_chunk=16, host_kv_tokens=0)
    _add(eng, "r", segs, cache)
    got = []
    b_node = None
    for step in range(1, 5):  # slices A, B, C, D
        got += eng.step()
        r = eng.prefilling.get("r")
        path = eng.cache.path_to(r.last_node) if r is not None else []
        b_node = b_node or next(n for n in path if n.kind == "tokens" and n.tok_start == 16)
        pinned = b_node.id in eng.cache.tree.pinned
        # Pinned while A's, B's and C's slices run (step 1 pins all the plan uses); the
        # step that runs D's slice pins only what D's rows read.
        assert pinned == (step < 4), step
        assert b_node.id in eng.cache.tree.dead()
    assert eng.cache.tree.evict(2) >= 2 and b_node.pages is None  # dead, unpinned: freed
    while eng.has_work():
        got += eng.step()
    ref_toks, ref_lps = dense_generate(dm, segs, parse_history(cache, 4), N_NEW)
    assert [ev.token_id for ev in got if ev.rid == "r"] == ref_toks
    np.testing.assert_allclose([ev.logprob for ev in got if ev.rid == "r"], ref_lps, atol=1e-4)
