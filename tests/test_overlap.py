"""Overlap scheduling (serving/overlap.py): greedy decode tokens read a step late, the next
step fed from the device. Against the dense reference and against the same engine reading
every token in its own step: the same tokens, stops, lengths and cache, early stops (the
wasted row a step late), preemption, aborts and unusable rows included."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_cases import random_requests
from exactness import dense_greedy

from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import parse_history
from akv_jax.model.params import init_params
from akv_jax.model.presets import tiny_config
from akv_jax.serving.engine import Engine
from akv_jax.serving.types import GenerateRequest, SamplingParams
from akv_jax.serving.work import PENDING

MAX_NEW = 7


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("qwen3")
    params = init_params(cfg, jax.random.key(5))
    return SimpleNamespace(cfg=cfg, params=params, tokenizer=None), DenseModel(params, cfg)


def _cases(dm, rng, reqs, max_new: int) -> list[tuple]:
    """``reqs`` with their dense reference tokens and log-probs, each with a stop id taken
    from those tokens (so most stop early, some at their first token) and a length limit."""
    out = []
    for segs, cache in reqs:
        toks, lps = dense_greedy(dm, segs, parse_history(cache, len(segs)), max_new)
        limit = int(rng.integers(max_new // 2 + 1, max_new + 1))
        stop = toks[int(rng.integers(0, max_new))] if rng.random() < 0.7 else -5
        end = next((i + 1 for i, t in enumerate(toks[:limit]) if t == stop), None)
        want = (toks[: end or limit], lps[: end or limit], "stop" if end else "length")
        out.append((segs, cache, SamplingParams(max_new_tokens=limit, stop_token_ids=(stop,),
                                                ignore_eos=True), want))
    return out


@pytest.fixture(scope="module")
def cases(model):
    """Random histories with ops (drops, repos, extensions of earlier ones)."""
    rng = np.random.default_rng(8)
    return _cases(model[1], rng, random_requests(rng, 14), MAX_NEW)


def _long_cases(dm, seed: int) -> list[tuple]:
    """Four long decodes: in a pool that holds about two, they preempt each other."""
    rng = np.random.default_rng(seed)
    reqs = [([rng.integers(0, 256, 20).tolist(), rng.integers(0, 256, 12).tolist()],
             {"drop": {}, "reposition": []}) for _ in range(4)]
    return _cases(dm, rng, reqs, 40)


@pytest.fixture(scope="module")
def long_cases(model):
    return _long_cases(model[1], 4)


def _request(rid, segs, cache, sp) -> GenerateRequest:
    return GenerateRequest(rid, segs, parse_history(cache, len(segs)), sp, return_logprob=True)


def _drive(eng: Engine, cases, per_step: int | None) -> dict[str, list]:
    """Every case sent (``per_step`` more before each step, or one at a time when None) and
    run to the end; each request's events."""
    got: dict[str, list] = {}
    todo = list(enumerate(cases))
    steps = 0
    while todo or eng.has_work():
        n = per_step if per_step is not None else (0 if eng.has_work() else 1)
        for k, (segs, cache, sp, _) in todo[:n]:
            eng.add_request(_request(str(k), segs, cache, sp))
            got[str(k)] = []
        del todo[:n]
        for ev in eng.step():
            assert not got[ev.rid] or not got[ev.rid][-1].finished, "an event after the last"
            got[ev.rid].append(ev)
        steps += 1
        assert steps < 2000, "no progress"
    return got


def _leaf_paths(eng: Engine) -> list[tuple]:
    """Every root-to-leaf path of the radix tree as one tuple of keys."""
    out = []

    def walk(node, prefix):
        path = prefix + tuple(np.asarray(node.key).tolist()) if node.kind == "tokens" else (
            prefix + tuple(node.key))
        if not node.children:
            out.append(path)
        for group in node.children.values():
            for child in group:
                walk(child, path)

    walk(eng.cache.tree.root, ())
    return sorted(out, key=repr)


def _check(got: dict[str, list], cases) -> None:
    for k, (_, _, _, (toks, lps, reason)) in enumerate(cases):
        evs = got[str(k)]
        assert [ev.token_id for ev in evs] == toks, k
        np.testing.assert_allclose([ev.logprob for ev in evs], lps, atol=1e-4)
        last = evs[-1]
        assert last.finished and last.finish_reason == reason, k
        assert last.meta["completion_tokens"] == len(toks), k
        assert all(not ev.finished for ev in evs[:-1]), k


@pytest.mark.parametrize("which, pool_tokens", [("cases", 4096), ("long_cases", 8 * 20)])
def test_stops_and_lengths_equal_the_reference_with_and_without_overlap(model, request, which,
                                                                          pool_tokens):
    """A stream of arrivals (3 before each step) in a roomy pool, and long decodes in one so
    small that they preempt each other: every answer is the reference's, stopped where its
    stop id or length says, with overlap and without."""
    m, _ = model
    cases = request.getfixturevalue(which)
    runs = {}
    for overlap in (True, False):
        # admission_window_s=0: admission that does not depend on the clock (deterministic)
        eng = Engine(m, max_total_tokens=pool_tokens, page_size=8,
                     attention_backend="reference", host_kv_tokens=0, overlap=overlap,
                     admission_window_s=0.0)
        got = _drive(eng, cases, per_step=3)
        _check(got, cases)
        assert eng.deferred is None and not eng.has_work()
        runs[overlap] = eng
        if which == "long_cases":
            assert eng.counters["preemptions"] > 0
    if which == "cases":  # nothing evicted: both caches hold every turn alike
        assert _leaf_paths(runs[True]) == _leaf_paths(runs[False])
    for eng in runs.values():
        assert eng.flush_cache() and eng.cache.pool.used_pages == 0


@pytest.mark.parametrize("seed, pool_tokens", [(2, 160), (4, 136)])
def test_a_full_pool_waits_for_the_deferred_tokens_before_failing_a_request(model, seed,
                                                                           pool_tokens):
    """When every decoding request waits for a page, tokens still on the device may end
    requests and free theirs: the engine reads them before it fails anyone for want of
    pages (these cases once failed one with "the KV pool is full")."""
    m, dm = model
    cases = _long_cases(dm, seed)
    eng = Engine(m, max_total_tokens=pool_tokens, page_size=8, attention_backend="reference",
                 host_kv_tokens=0, admission_window_s=0.0)
    _check(_drive(eng, cases, per_step=3), cases)
    assert eng.counters["preemptions"] > 0 and eng.counters["requests_failed"] == 0


def test_one_at_a_time_the_bits_are_those_without_overlap(model, cases):
    """Requests run one at a time form the same batches with or without overlap, so the
    log-probs agree bit for bit, and the caches they leave are the same."""
    m, _ = model
    got, engines = {}, {}
    for overlap in (True, False):
        eng = Engine(m, max_total_tokens=4096, page_size=8, attention_backend="reference",
                     overlap=overlap)
        got[overlap], engines[overlap] = _drive(eng, cases, per_step=None), eng
    _check(got[True], cases)
    for k in got[True]:
        a, b = got[True][k], got[False][k]
        assert [e.token_id for e in a] == [e.token_id for e in b]
        assert (np.asarray([e.logprob for e in a], np.float32).view(np.int32)
                == np.asarray([e.logprob for e in b], np.float32).view(np.int32)).all()
        assert a[-1].meta == b[-1].meta
    assert _leaf_paths(engines[True]) == _leaf_paths(engines[False])


def _decoding(eng: Engine, reqs: list[GenerateRequest]) -> dict[str, list]:
    """Run ``reqs`` until each has a deferred token; their events so far."""
    got: dict[str, list] = {r.rid: [] for r in reqs}
    for r in reqs:
        eng.add_request(r)
    while not (eng.deferred and len(eng.deferred.rows) == len(reqs)):
        for ev in eng.step():
            assert ev.error is None
            got[ev.rid].append(ev)
    return got


def _long(rid: str, prompt: list[int], n: int = 12) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return GenerateRequest(rid, [prompt], parse_history(None, 1), sp, return_logprob=True)


def test_the_next_step_feeds_a_deferred_token_before_it_is_read(model):
    m, dm = model
    eng = Engine(m, max_total_tokens=1024, page_size=8, attention_backend="reference")
    _decoding(eng, [_long("a", [5, 6, 7, 8, 9])])
    (r,) = eng.running.values()
    assert r.generated[-1] == PENDING and r.completion_tokens == len(r.generated) - 1
    seen = []
    real = eng.executor.run_decode

    def run_decode(work, previous=None):
        seen.append([(p.tokens[-1], p.pending_from) for _, p in work])
        return real(work, previous)

    eng.executor.run_decode = run_decode
    events = eng.step()
    assert seen == [[(PENDING, 0)]]  # fed from row 0 of the step before, unread
    assert [ev.token_id for ev in events] == r.generated[len(r.generated) - 2 : -1]
    toks, _ = dense_greedy(dm, [[5, 6, 7, 8, 9]], parse_history(None, 1), 12)
    while eng.has_work():
        events += eng.step()
    assert r.generated == toks


def test_abort_while_a_token_is_deferred_frees_everything(model):
    m, dm = model
    eng = Engine(m, max_total_tokens=1024, page_size=8, attention_backend="reference")
    got = _decoding(eng, [_long("a", list(range(3, 20))), _long("b", list(range(30, 41)))])
    eng.abort("b")
    while eng.has_work():
        for ev in eng.step():
            got[ev.rid].append(ev)
    assert not got["b"] or not got["b"][-1].finished  # aborted: nothing more was sent
    toks, _ = dense_greedy(dm, [list(range(3, 20))], parse_history(None, 1), 12)
    assert [ev.token_id for ev in got["a"]] == toks and got["a"][-1].finish_reason == "length"
    assert eng.flush_cache() and eng.cache.pool.used_pages == 0


def test_an_unusable_deferred_row_fails_its_request_only(model):
    """A row with NaN logits, read a step late (after the next step fed its greedy token):
    that request fails with the sampler's reason and releases its pages; the other goes on
    to the reference's answer."""
    m, dm = model
    eng = Engine(m, max_total_tokens=1024, page_size=8, attention_backend="reference")
    got = _decoding(eng, [_long("a", list(range(3, 20))), _long("v", list(range(30, 41)))])
    real = eng.executor.run_decode
    poisoned = []

    def run_decode(work, previous=None):
        out = real(work, previous)
        rows = [i for i, (r, _) in enumerate(work) if r.rid == "v"]
        if rows and not poisoned:
            poisoned.append(rows[0])
            out = out._replace(logits=out.logits.at[rows[0]].set(jnp.nan),
                               ok=out.ok.at[rows[0]].set(False))
        return out

    eng.executor.run_decode = run_decode
    while eng.has_work():
        for ev in eng.step():
            got[ev.rid].append(ev)
    assert got["v"][-1].finish_reason == "error" and "NaN" in got["v"][-1].error
    toks, _ = dense_greedy(dm, [list(range(3, 20))], parse_history(None, 1), 12)
    assert [ev.token_id for ev in got["a"]] == toks
    assert got["a"][-1].finish_reason == "length"
    assert eng.flush_cache() and eng.cache.pool.used_pages == 0


def test_a_request_preempted_before_its_deferred_token_is_read_may_end_from_the_queue(
        model, long_cases):
    """Preemption takes a request whose last token is still on the device; when that token
    is read and is its stop id, the request ends from the waiting queue: the answer is the
    reference's, cut there, and nothing leaks."""
    m, _ = model
    plain = [(segs, cache, SamplingParams(max_new_tokens=40, ignore_eos=True), None)
             for segs, cache, _, _ in long_cases]

    def run(cases):
        eng = Engine(m, max_total_tokens=8 * 20, page_size=8, attention_backend="reference",
                     host_kv_tokens=0)
        read_queued, ended_queued = [], []
        real_resolve, real_finish = eng.tokens.resolve, eng.finish

        def resolve(r, index, tok, lp):
            if r.status == "waiting":
                read_queued.append((r.rid, index, tok))
            return real_resolve(r, index, tok, lp)

        def finish(r, reason):
            if r.status == "waiting":
                ended_queued.append(r.rid)
            return real_finish(r, reason)

        eng.tokens.resolve, eng.tokens.finish = resolve, finish
        return _drive(eng, cases, per_step=3), read_queued, ended_queued, eng

    got, read_queued, _, _ = run(plain)
    assert read_queued, "no request was preempted with its token unread"
    rid, index, tok = read_queued[0]
    k = int(rid)
    toks = [ev.token_id for ev in got[rid]]
    assert toks[index] == tok and tok not in toks[:index]
    segs, cache, _, _ = long_cases[k]
    full_toks, full_lps = dense_greedy(model[1], segs, parse_history(cache, len(segs)), 40)
    cases = list(plain)
    cases[k] = (segs, cache, SamplingParams(max_new_tokens=40, stop_token_ids=(tok,),
                                            ignore_eos=True), None)
    got, _, ended_queued, eng = run(cases)
    assert ended_queued == [rid]
    assert [ev.token_id for ev in got[rid]] == full_toks[: index + 1]
    np.testing.assert_allclose([ev.logprob for ev in got[rid]], full_lps[: index + 1],
                               atol=1e-4)
    assert got[rid][-1].finish_reason == "stop"
    assert not eng.has_work() and eng.flush_cache() and eng.cache.pool.used_pages == 0
