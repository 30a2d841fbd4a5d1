"""The request-order exactness harness (DESIGN.md §2: a request's answer depends on the
request alone), shared by the single-device and the multidevice test processes.

One random request set (fresh histories of 3-7 segments with drops in the middle and at the
last boundary, repositions, multi-turn extensions of earlier requests) is sent to one engine
in several orders: one at a time in random orders, all at once, after a flush, in reverse
order (every extension before its base), and through a pool so small that most state is
evicted and restored between requests. Every answer is compared with the deliberately naive
dense reference (tokens equal, float32 log-probs within 1e-4) and, on request, with the same
request's answer alone on the emptied engine, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import jax
import numpy as np

from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import add_random_ops, parse_history
from akv_jax.cache.timeline import timeline
from akv_jax.model.params import init_params
from akv_jax.model.presets import tiny_config
from akv_jax.serving.admission import pages_bound
from akv_jax.serving.engine import Engine
from akv_jax.serving.types import GenerateRequest, SamplingParams

N_NEW = 8
LOGPROB_ATOL = 1e-4
POOL_TIMES = (1, 2)  # pools that force eviction: nearly always, and now and then
REPEATS = 3  # copies of each request in the concurrent small-pool phases
MAX_STEPS = 20_000  # a request set that has not finished by then has hung


def random_histories(rng: np.random.Generator, count: int, vocab: int,
                     answer: Callable[[list, dict], list[int]] | None = None) -> list[tuple]:
    """``count`` requests ``(segments, cache)``: about 60% fresh histories of 3-7 segments,
    the rest multi-turn extensions (1-3 more segments, more ops) of an earlier request. With
    ``answer`` (the reference's greedy tokens for a request), half the extensions go on
    from the earlier request's answer, as an agent's next turn does: their path then runs
    through the KV the server cached while generating it."""
    reqs: list[tuple] = []
    while len(reqs) < count:
        if reqs and rng.random() < 0.4:
            segs, cache = reqs[int(rng.integers(len(reqs)))]
            segs = [list(s) for s in segs]
            cache = {"drop": {k: list(v) for k, v in cache["drop"].items()},
                     "reposition": list(cache["reposition"])}
            more = int(rng.integers(1, 4))
            if answer is not None and rng.random() < 0.5:
                segs.append(answer(segs, cache))
                more -= 1
        else:
            segs, cache = [], {"drop": {}, "reposition": []}
            more = int(rng.integers(3, 8))
        dropped = {i for v in cache["drop"].values() for i in v}
        for _ in range(more):
            segs.append(rng.integers(0, vocab, size=int(rng.integers(1, 30))).tolist())
            s = len(segs) - 1
            # Middle segments mostly; the segment just appended (the last boundary) too.
            add_random_ops(rng, cache, s, dropped, p_drop=0.25, p_repos=0.3)
        reqs.append((segs, cache))
    return reqs


def reference_answer(dm: DenseModel) -> Callable[[list, dict], list[int]]:
    """The dense reference's greedy answer to a request, for agent-style extensions."""
    return lambda segs, cache: dense_answers(dm, [(segs, cache)])[0][0]


def dense_greedy(dm: DenseModel, segs: list, history, n: int) -> tuple[list, list]:
    """Greedy tokens and their float log-probs from the dense reference."""
    logits, st = dm.run(segs, history)
    last, toks, lps = logits[-1], [], []
    for i in range(n):
        lp = last - (np.log(np.exp(last - last.max()).sum()) + last.max())
        t = int(np.argmax(last))
        toks.append(t)
        lps.append(float(lp[t]))
        if i < n - 1:
            lg, st = dm.append(st, [t])
            last = lg[-1]
    return toks, lps


def dense_answers(dm: DenseModel, reqs: list[tuple], n: int | None = None) -> list[tuple]:
    """``(tokens, logprobs)`` of greedy generation by the dense reference, per request."""
    return [dense_greedy(dm, segs, parse_history(cache, len(segs)), n or N_NEW)
            for segs, cache in reqs]


def run_requests(engine: Engine, reqs: list[tuple], order: list[int], concurrent: bool | int,
                 n: int | None = None) -> list[tuple]:
    """Send ``reqs[i]`` for each ``i`` in ``order`` (an index may repeat): one at a time
    (False), all at once (True), or ``k`` more before every step (an int: a steady stream of
    arrivals, so prefills keep allocating while others decode). ``(tokens, logprobs, meta)``
    per entry of ``order``. Greedy, EOS ignored (the reference does not stop either)."""
    out: dict[str, tuple] = {}
    pending = list(enumerate(order))
    steps = 0
    while pending or engine.has_work():
        added = 0
        while pending and (
            concurrent is True
            or (concurrent is False and not engine.has_work())
            or (not isinstance(concurrent, bool) and added < concurrent)
        ):
            added += 1
            k, i = pending.pop(0)
            segs, cache = reqs[i]
            sp = SamplingParams(max_new_tokens=n or N_NEW, ignore_eos=True)
            engine.add_request(
                GenerateRequest(str(k), segs, parse_history(cache, len(segs)), sp, True)
            )
        for ev in engine.step():
            toks, lps, meta = out.setdefault(ev.rid, ([], [], {}))
            toks.append(ev.token_id)
            lps.append(ev.logprob)
            if ev.finished:
                meta.update(ev.meta)
        steps += 1
        assert steps < MAX_STEPS, "the engine stopped making progress"
    return [out[str(k)] for k in range(len(order))]


def mismatches(refs: list[tuple], order: list[int], got: list[tuple],
               alone: list[tuple] | None = None) -> list[str]:
    """Each answer against the dense reference (tokens, log-probs to 1e-4) and, given
    ``alone`` (each request's answer alone on an empty engine of the same kind), against
    that bit for bit (DESIGN §4.1)."""
    bad = []
    for i, (toks, lps, meta) in zip(order, got, strict=True):
        ref_toks, ref_lps = refs[i]
        if meta.get("finish_reason") != "length":
            bad.append(f"request {i} finished with {meta.get('finish_reason')!r}")
        elif toks != ref_toks:
            bad.append(f"request {i}: tokens {toks} != reference {ref_toks}")
        elif not np.allclose(lps, ref_lps, rtol=0, atol=LOGPROB_ATOL):
            err = np.max(np.abs(np.asarray(lps) - np.asarray(ref_lps)))
            bad.append(f"request {i}: log-probs off by {err:.3g}")
        elif alone is not None and not np.array_equal(float32_bits(lps),
                                                      float32_bits(alone[i][1])):
            at = np.nonzero(float32_bits(lps) != float32_bits(alone[i][1]))[0].tolist()
            bad.append(f"request {i}: log-prob bits differ from it alone at {at}")
    return bad


def float32_bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.int32)


def answers_alone(engine: Engine, reqs: list[tuple]) -> list[tuple]:
    """Each request alone on ``engine`` emptied before it (the engine's cache flushed)."""
    out = []
    for i in range(len(reqs)):
        assert engine.flush_cache()
        out += run_requests(engine, reqs, [i], False)
    assert engine.flush_cache()
    return out


def pool_that_forces_eviction(reqs: list[tuple], page_size: int, times: float,
                              n_new: int | None = None) -> int:
    """``max_total_tokens`` for a pool that holds ``times`` the largest request (generating
    ``n_new`` tokens), so much of the state of a set is evicted and restored between its
    requests."""
    need = max(
        pages_bound(timeline([len(x) for x in segs], parse_history(c, len(segs))),
                    n_new or N_NEW, parse_history(c, len(segs)), page_size)
        for segs, c in reqs
    )
    return page_size * int(need * times)


def exact_in_any_order(make_engine: Callable[..., Engine], model, reqs: list[tuple],
                       refs: list[tuple], seed: int, page_size: int = 4,
                       host_tier: bool = True, bitwise: bool = False) -> dict:
    """Run the whole protocol; returns counters of the small-pool engine. Raises
    AssertionError listing every mismatch with the phase it appeared in. ``host_tier``: also
    the host-tier phases (the tier copies bytes, whatever the attention backend or model: the
    callers run them once per topology, not once per backend and model). ``bitwise``: also
    each answer against the request alone, bit for bit."""
    rng = np.random.default_rng(seed)
    n = len(reqs)
    forward, backward = list(range(n)), list(range(n))[::-1]
    bad: list[str] = []

    big = make_engine(max_total_tokens=16384, page_size=page_size)
    alone = answers_alone(big, reqs) if bitwise else None

    def phase(eng, name, order, concurrent):
        got = run_requests(eng, reqs, order, concurrent)
        bad.extend(f"{name}: {m}" for m in mismatches(refs, order, got, alone))

    phase(big, "serial", forward, False)
    phase(big, "concurrent", list(rng.permutation(n)), True)
    assert big.flush_cache() and big.cache.pool.used_pages == 0
    phase(big, "after flush, reversed", backward, False)
    phase(big, "random order", list(rng.permutation(n)), False)
    assert big.flush_cache() and big.cache.pool.used_pages == 0, "pages leaked"

    for times in POOL_TIMES:
        # No host tier: evicted live KV is recomputed by one-pass restores.
        small = make_engine(
            max_total_tokens=pool_that_forces_eviction(reqs, page_size, times),
            page_size=page_size, host_kv_tokens=0,
        )
        name = f"pool of {times}x the largest request"
        phase(small, f"{name}, reversed", backward, False)
        phase(small, f"{name}, random order", list(rng.permutation(n)), False)
        # Every request several times, all at once: identical requests share their whole
        # path, and many allocations fall while others decode.
        phase(small, f"{name}, concurrent", list(rng.permutation(REPEATS * n) % n), True)
        phase(small, f"{name}, one arrival a step", list(rng.permutation(REPEATS * n) % n), 1)
    stats = small.stats()
    assert small.flush_cache() and small.cache.pool.used_pages == 0, "pages leaked"

    # A device pool that holds just the largest request, and a host tier that holds the
    # rest (evicted live KV is spilled and reloaded) or too little (some is spilled, the
    # rest recomputed; host copies are evicted in turn). Concurrent phases preempt.
    tokens = pool_that_forces_eviction(reqs, page_size, 1)
    for host, label in ((64 * tokens, "all"), (tokens // 4, "a quarter")) if host_tier else ():
        tiered = make_engine(max_total_tokens=tokens, page_size=page_size,
                             host_kv_tokens=host)
        name = f"pool of 1x the largest request, host tier for {label} of it"
        # Each request once (the repeated phases above already share whole paths).
        if label == "all":
            phase(tiered, f"{name}, one arrival a step", list(rng.permutation(n)), 1)
        else:
            phase(tiered, f"{name}, reversed", backward, False)
        phase(tiered, f"{name}, concurrent", list(rng.permutation(n)), True)
        tier = tiered.stats()
        stats.update({f"{k}[{label}]": v for k, v in tier.items()})
        assert tiered.flush_cache() and tiered.cache.pool.used_pages == 0, "pages leaked"
        assert tiered.cache.host_used_pages == 0, "host pages leaked"
    assert not bad, "\n".join(bad)
    return stats


def tiny_dense_model() -> SimpleNamespace:
    """The tiny random Qwen3 of the dense protocol runs (seed 1), as the engine takes it."""
    cfg = tiny_config("qwen3")
    return SimpleNamespace(cfg=cfg, params=init_params(cfg, jax.random.key(1)), tokenizer=None)


def check_protocol(model, topology: dict, num_requests: int, history_seed: int,
                   order_seed: int, host_tier: bool = False, bitwise: bool = False,
                   backend: str = "reference") -> None:
    """Random histories through :func:`exact_in_any_order` on ``topology`` (Engine keyword
    arguments: ``tp``, ``disaggregate``) with attention ``backend``, against the dense
    reference (``bitwise``: and each answer against the request alone on the same topology,
    bit for bit); the small pool must really evict and restore. ``host_tier``: with the host
    tier's phases (once per topology: the tier moves bytes, whatever the model). For the
    multidevice processes."""
    if jax.device_count() < 4:
        import pytest  # here, not at the top: bench/device_check.py runs the harness without it

        pytest.fail("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (own process)")
    dm = DenseModel(model.params, model.cfg)
    reqs = random_histories(np.random.default_rng(history_seed), num_requests,
                            vocab=model.cfg.vocab_size, answer=reference_answer(dm))
    refs = dense_answers(dm, reqs)

    def make_engine(**kw):
        return Engine(model, attention_backend=backend, **topology, **kw)

    stats = exact_in_any_order(make_engine, model, reqs, refs, seed=order_seed,
                               host_tier=host_tier, bitwise=bitwise)
    assert stats["evictions"] > 0 and stats["restores"] > 0
    if host_tier:  # under tensor parallelism / disaggregation: spilled and reloaded
        assert stats["offloaded_pages[all]"] > 0 and stats["reloaded_pages[all]"] > 0
