"""What the bit-for-bit tests share (issue 38): a probe request with drops and repos, the
situations it is run in (from the cache, after eviction, amid batches, beside sliced
prompts, ...), and the comparison of its tokens and float32 log-prob bits with the same
request alone on a fresh engine. Used on one device (test_bitwise.py, test_deterministic.py)
and on forced host devices (test_bitwise_multidevice.py)."""

import dataclasses
from types import SimpleNamespace

import jax
import numpy as np

from akv_jax.cache.ops import parse_history
from akv_jax.model.params import init_params
from akv_jax.model.presets import tiny_config
from akv_jax.serving.engine import Engine
from akv_jax.serving.types import GenerateRequest, SamplingParams

N_NEW = 12
VOCAB = 500


def bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.int32)


def setup(arch: str, tied: bool = False, **engine_kw) -> SimpleNamespace:
    """A tiny model of ``arch`` (``tied``: its output head the embedding) and the engine
    arguments every engine of a test takes."""
    cfg = dataclasses.replace(tiny_config(arch), tie_word_embeddings=tied)
    m = SimpleNamespace(cfg=cfg, params=init_params(cfg, jax.random.key(5)), tokenizer=None)
    return SimpleNamespace(model=m, kw=engine_kw)


def segments() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, VOCAB, n).tolist() for n in (40, 70, 25, 90, 33, 18)]


PROBES = {
    "drops": {"drop": {"3": [1], "5": [3]}, "reposition": []},
    "drops+repos": {"drop": {"3": [1], "5": [3]}, "reposition": [2, 4]},
}
SAMPLED = dict(PROBES["drops+repos"], temperature=0.8, top_p=0.95, seed=11)


def probe_request(cache: dict, rid: str = "probe", upto: int | None = None,
                  max_new: int = N_NEW) -> GenerateRequest:
    segs = segments()[:upto]
    n = len(segs)
    c = {"drop": {k: v for k, v in cache["drop"].items() if int(k) < n},
         "reposition": [b for b in cache["reposition"] if b < n]}
    sampling = {k: cache[k] for k in ("temperature", "top_p", "seed") if k in cache}
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True, **sampling)
    return GenerateRequest(rid, segs, parse_history(c, n), sp, return_logprob=True)


def other_request(i: int, n: int | None = None) -> GenerateRequest:
    r = np.random.default_rng(100 + i)
    n = n or int(r.integers(5, 300))
    sp = SamplingParams(max_new_tokens=int(r.integers(3, 20)), ignore_eos=True)
    return GenerateRequest(f"o{i}", [r.integers(0, VOCAB, n).tolist()], parse_history(None, 1),
                           sp)


def engine(setup, **kw) -> Engine:
    # admission_window_s=0: admission that does not read the clock
    args = dict(max_total_tokens=8192, page_size=8, admission_window_s=0.0)
    return Engine(setup.model, **(args | setup.kw | kw))


def drive(eng: Engine, schedule: dict[int, list[GenerateRequest]], rid: str = "probe"):
    """Requests added before the steps ``schedule`` names; ``rid``'s tokens and log-probs."""
    got: dict[str, list] = {}
    step = 0
    while schedule or eng.has_work():
        for r in schedule.pop(step, []):
            eng.add_request(r)
            got[r.rid] = []
        for ev in eng.step():
            assert ev.error is None, ev.error
            got[ev.rid].append(ev)
        step += 1
        assert step < 5000, "no progress"
    return [e.token_id for e in got[rid]], [e.logprob for e in got[rid]]


def from_cache(model, cache, **kw):
    eng = engine(model, **kw)
    drive(eng, {0: [probe_request(cache, "first")]}, "first")
    return drive(eng, {0: [probe_request(cache)]})


def after_prefixes(model, cache):
    eng = engine(model)
    for k in (2, 4):
        drive(eng, {0: [probe_request(cache, f"pre{k}", upto=k, max_new=3)]}, f"pre{k}")
    return drive(eng, {0: [probe_request(cache)]})


def after_first_prefix(model, cache):
    """Its first two segments cached: both of its repos versions are copies of that KV (the
    second re-rotated from the first, in the same pass)."""
    eng = engine(model)
    drive(eng, {0: [probe_request(cache, "pre2", upto=2, max_new=3)]}, "pre2")
    return drive(eng, {0: [probe_request(cache)]})


def after_a_partial_match(model, cache):
    """A request that shared its first segment and part of its second was cached: its KV
    serves the probe, in nodes that end mid-page (a view laid out with holes)."""
    eng = engine(model)
    segs = segments()
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    other = [segs[0], segs[1][:29] + list(range(7))]
    drive(eng, {0: [GenerateRequest("pre", other, parse_history(None, 2), sp)]}, "pre")
    return drive(eng, {0: [probe_request(cache)]})


def after_eviction(model, cache, host_kv_tokens):
    """Run once, its path then evicted by others: back from the host tier (reloaded) or,
    without one, recomputed by a one-pass restore."""
    eng = engine(model, max_total_tokens=800, host_kv_tokens=host_kv_tokens)
    drive(eng, {0: [probe_request(cache, "first")]}, "first")
    for i in range(3):
        drive(eng, {0: [other_request(i, 250)]}, f"o{i}")
    got = drive(eng, {0: [probe_request(cache)]})
    stats = eng.stats()
    assert stats["evictions"] > 0
    assert stats["reloaded_pages" if host_kv_tokens else "restored_tokens"] > 0, stats
    return got


SCENARIOS = {
    "from the cache": from_cache,
    "after its prefixes were cached": after_prefixes,
    "after its first prefix was cached": after_first_prefix,
    "after a partial match was cached": after_a_partial_match,
    "evicted, reloaded from the host tier": lambda m, c: after_eviction(m, c, 8192),
    "evicted, recomputed": lambda m, c: after_eviction(m, c, 0),
    "amid 3 arriving with it": lambda m, c: drive(
        engine(m), {0: [other_request(i) for i in range(3)] + [probe_request(c)]}),
    "amid 7 decoding when it arrives": lambda m, c: drive(
        engine(m), {0: [other_request(i) for i in range(7)], 3: [probe_request(c)]}),
    "amid 16 arriving while it decodes": lambda m, c: drive(
        engine(m), {0: [probe_request(c)], 2: [other_request(i) for i in range(16)]}),
    "beside a long prompt in slices": lambda m, c: drive(
        engine(m, prefill_chunk=64), {0: [other_request(99, 600), probe_request(c)]}),
    "prefill_chunk 128": lambda m, c: drive(engine(m, prefill_chunk=128), {0: [probe_request(c)]}),
    "preempted in a small pool": lambda m, c: drive(
        engine(m, max_total_tokens=700, host_kv_tokens=0),
        {0: [other_request(i, 150) for i in range(2)] + [probe_request(c)]}),
}


def same_as_alone(setup, cache: dict, scenarios: list[str]) -> None:
    want_toks, want_lps = drive(engine(setup), {0: [probe_request(cache)]})
    for name in scenarios:
        toks, lps = SCENARIOS[name](setup, cache)
        assert toks == want_toks, name
        np.testing.assert_array_equal(bits(lps), bits(want_lps), err_msg=name)
