"""Sampling: temperature, top-k, top-p and seeds (issue 12, part 2).

1. The sampler's distribution (``sampler.sampling_probs``, the vector ``sample`` draws from)
   equals a deliberately naive reference (Python loops over a sorted list) on thousands of
   random logit rows, with ties, ``-inf`` entries, extreme temperatures, ``top_k`` past the
   vocabulary and ``top_p`` at exact cumulative boundaries.
2. The engine's first sampled token over many seeds follows the softmax of the dense
   reference's logits: a chi-square test at a stated false-alarm rate (deterministic seeds,
   so the outcome is fixed), which also rejects the same samples against a wrong temperature.
3. A seeded request gives the same tokens alone, beside other random requests, and after them.
4. The HTTP layer: identical seeds give identical outputs on both endpoints; bad values are 400s
   that name the field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest
from server_support import sse_events

from akv_jax.serving.sampler import (
    invalid_param,
    log_softmax,
    make_rng,
    sample,
    sampling_probs,
)


@dataclass(frozen=True)
class SP:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


# --------------------------------------------------------------------------- 1. the math


def naive_probs(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The reference: one token at a time, no vectorised masking.

    top-k keeps a token iff fewer than ``top_k`` tokens have a strictly larger logit (so ties
    at the k-th value are kept); top-p walks the tokens in decreasing probability, keeping each
    while the mass already kept is below ``top_p`` (at least one), plus any token tied with
    the last one kept. The softmax itself is the plain numpy one the sampler uses, so that the
    cumulative sums compared with ``top_p`` are the same floats on both sides.
    """
    x = [float(v) for v in logits]
    V = len(x)
    if temperature == 0:
        best = max(range(V), key=lambda i: (x[i], -i))  # first index of the maximum
        return np.eye(V)[best]
    m = max(x)
    z = [(v - m) / temperature for v in x]
    keep = [True] * V
    if top_k > 0:
        for i in range(V):
            larger = 0
            for j in range(V):
                if z[j] > z[i]:
                    larger += 1
            keep[i] = larger < top_k
    zk = np.array([z[i] if keep[i] else -math.inf for i in range(V)])
    e = np.exp(zk)
    p = e / e.sum()
    if top_p < 1.0:
        order = sorted(range(V), key=lambda i: -p[i])
        allowed = set()
        mass = 0.0  # sequential, like np.cumsum
        last = None
        for i in order:
            if not allowed or mass < top_p or p[i] == last:
                allowed.add(i)
                last = p[i]
                mass += p[i]
            else:
                break
        p = np.array([p[i] if i in allowed else 0.0 for i in range(V)])
        p = p / p.sum()
    return p


def random_row(rng: np.random.Generator) -> np.ndarray:
    V = int(rng.choice([1, 2, 3, 7, 16, 40, 64]))
    kind = rng.integers(6)
    if kind == 0:
        x = rng.normal(0, 3, V)
    elif kind == 1:  # many ties
        x = rng.integers(-3, 3, V).astype(np.float64)
    elif kind == 2:  # huge logits (a tiny temperature's overflow, without the temperature)
        x = rng.normal(0, 1e4, V)
    elif kind == 3:  # masked entries
        x = rng.normal(0, 2, V)
        x[rng.random(V) < 0.4] = -np.inf
        x[rng.integers(V)] = rng.normal()  # at least one finite
    elif kind == 4:  # all equal
        x = np.full(V, rng.normal())
    else:  # float32 logits, as the model returns them
        x = rng.normal(0, 1, V).astype(np.float32)
    return x


def random_params(rng: np.random.Generator, x: np.ndarray) -> SP:
    V = x.size
    temperature = float(rng.choice([0.0, 1e-300, 5e-324, 0.05, 0.7, 1.0, 2.5, 100.0]))
    top_k = int(rng.choice([0, 1, 2, 3, max(1, V - 1), V, V + 5, 10**9]))
    top_p = float(rng.choice([1.0, 1e-12, 0.1, 0.5, 0.9, 0.999]))
    if temperature > 0 and rng.random() < 0.3:
        # top_p exactly at a cumulative sum the sampler computes: the prefix that sums to
        # exactly top_p is kept, the next token is not (and one ulp more keeps it)
        p = naive_probs(x, temperature, top_k, 1.0)
        cum = np.cumsum(np.sort(p)[::-1])
        j = int(rng.integers(cum.size))
        if 0 < cum[j] < 1:
            top_p = float(cum[j]) if rng.random() < 0.5 else float(np.nextafter(cum[j], 2))
    return SP(temperature, top_p, top_k)


def test_sampling_probs_equal_the_naive_reference():
    rng = np.random.default_rng(0)
    kept_sizes = set()
    for case in range(3000):
        x = random_row(rng)
        sp = random_params(rng, x)
        got = sampling_probs(x, sp)
        want = naive_probs(x, sp.temperature, sp.top_k, sp.top_p)
        where = (case, x.tolist(), sp)
        np.testing.assert_array_equal(got > 0, want > 0, err_msg=str(where))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0, err_msg=str(where))
        assert got.sum() == pytest.approx(1.0, abs=1e-12)
        kept_sizes.add(int((got > 0).sum()))
    assert len(kept_sizes) > 20  # the cases cover many support sizes, not just 1 and V


def test_hand_computed_edges():
    x = np.array([2.0, 1.0, 1.0, 0.0, -np.inf])
    # top-k ties at the k-th value are all kept
    assert (sampling_probs(x, SP(1.0, 1.0, 2)) > 0).tolist() == [True, True, True, False, False]
    assert (sampling_probs(x, SP(1.0, 1.0, 1)) > 0).tolist() == [True, False, False, False, False]
    # top_k past the vocabulary is no top-k
    np.testing.assert_array_equal(sampling_probs(x, SP(1.0, 1.0, 99)), sampling_probs(x, SP()))
    # uniform: every prefix is tied with the next token, so top_p keeps all of them
    u = np.zeros(4)
    np.testing.assert_array_equal(sampling_probs(u, SP(1.0, 0.3, 0)), np.full(4, 0.25))
    # p = [1/2, 1/4, 1/4] exactly: 0.5 is reached by the first token alone; more needs the tie
    h = np.log(np.array([2.0, 1.0, 1.0]))
    p = sampling_probs(h, SP(1.0, 1.0, 0))
    assert p.tolist() == [0.5, 0.25, 0.25]
    assert sampling_probs(h, SP(1.0, 0.5, 0)).tolist() == [1.0, 0.0, 0.0]
    assert sampling_probs(h, SP(1.0, 0.5000001, 0)).tolist() == [0.5, 0.25, 0.25]
    # a tiny top_p (or a tiny temperature) is greedy; the tiniest temperatures do not overflow
    assert sampling_probs(x, SP(1.0, 1e-300, 0)).tolist() == [1.0, 0, 0, 0, 0]
    for t in (1e-300, 5e-324):
        assert sampling_probs(x, SP(t)).tolist() == [1.0, 0, 0, 0, 0]
        np.testing.assert_array_equal(sampling_probs(u, SP(t)), np.full(4, 0.25))
    # temperature 0 is the first maximum, drawing nothing from the generator
    g = make_rng(1)
    state = g.bit_generator.state
    assert sample(np.array([1.0, 3.0, 3.0]), SP(0.0), g)[0] == 1
    assert g.bit_generator.state == state


def test_logprob_is_the_models_not_the_tempered_one():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 2, 50).astype(np.float32)
    ref = log_softmax(x)
    np.testing.assert_allclose(np.exp(ref).sum(), 1.0, rtol=1e-12)
    for sp in (SP(0.0), SP(0.3, 0.8, 5), SP(2.0, 0.5, 0), SP(1.0, 1.0, 3)):
        g = make_rng(7)
        for _ in range(20):
            tok, lp = sample(x, sp, g)
            assert sampling_probs(x, sp)[tok] > 0
            assert lp == ref[tok]


def test_bad_rows_and_params_raise():
    for bad in ([0.0, np.nan], [np.inf, 0.0], [-np.inf, -np.inf], []):
        with pytest.raises(ValueError):
            sample(np.array(bad), SP(), make_rng(0))
        with pytest.raises(ValueError):
            sample(np.array(bad), SP(0.0), make_rng(0))
    for sp, field in [
        (SP(-0.1), "temperature"), (SP(float("nan")), "temperature"),
        (SP(float("inf")), "temperature"), (SP(1.0, 0.0), "top_p"), (SP(1.0, 1.01), "top_p"),
        (SP(1.0, float("nan")), "top_p"), (SP(1.0, 1.0, -1), "top_k"), (SP(1.0, 1.0, 2.5), "top_k"),
    ]:
        assert invalid_param(sp)[0] == field
        with pytest.raises(ValueError, match=field):
            sampling_probs(np.zeros(3), sp)
    assert invalid_param(SP(0.0, 1e-9, 10**12)) is None


def test_seeds():
    # any int64 seed works (numpy refuses negative ones); seeds >= 0 are numpy's own streams
    assert make_rng(5).random() == np.random.default_rng(5).random()
    draws = {make_rng(s).random() for s in (-(2**63), -1, 0, 1, 2**63 - 1)}
    assert len(draws) == 5
    assert make_rng(-1).random() == make_rng(-1).random()
    assert make_rng(None).random() != make_rng(None).random()


# --------------------------------------------------------------------------- 2. the engine

# The tiny model with its output head scaled up. Its own logits are nearly flat (std 0.14 over
# 512 tokens: every token has probability ~0.002), so no bin of a few thousand samples would
# tell temperatures apart; x30 gives logits of std ~4, a few likely tokens per prompt.
HEAD_SCALE = 30.0
ALPHA = 1e-3  # false-alarm rate of each chi-square test (for random seeds; ours are fixed)


@pytest.fixture(scope="module")
def sharp():
    from types import SimpleNamespace

    from akv_jax.cache.dense_reference import DenseModel
    from akv_jax.model.params import seeded_params
    from akv_jax.model.presets import tiny_config

    cfg = tiny_config("qwen3")
    params = seeded_params(cfg, 0)
    params = dataclasses.replace(params, lm_head=params.lm_head * HEAD_SCALE)
    return SimpleNamespace(cfg=cfg, params=params, tokenizer=None), DenseModel(params, cfg)


@pytest.fixture(scope="module")
def engine(sharp):
    """One engine for the module (its compiled shapes are most of the time): each test's
    requests run after the earlier tests' have filled its cache."""
    from akv_jax.serving.engine import Engine

    return Engine(sharp[0], max_total_tokens=8192, page_size=8, attention_backend="reference",
                  max_running=64)


def request(rid, segs, n, seed=None, temperature=1.0, top_p=1.0, top_k=0, cache=None):
    from akv_jax.cache.ops import parse_history
    from akv_jax.serving.types import GenerateRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=n, temperature=temperature, top_p=top_p, top_k=top_k,
                        seed=seed, ignore_eos=True)
    return GenerateRequest(rid, segs, parse_history(cache, len(segs)), sp, True)


def drive(engine, batches) -> dict[str, tuple[list[int], list[float]]]:
    """Run ``batches`` (lists of requests): each batch is added at once when the previous
    one has finished. Returns every request's tokens and log-probs."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for batch in batches:
        for req in batch:
            engine.add_request(req)
            out[req.rid] = ([], [])
        while engine.has_work():
            for ev in engine.step():
                if ev.token_id >= 0:
                    out[ev.rid][0].append(ev.token_id)
                    out[ev.rid][1].append(ev.logprob)
    return out


def chi_square(counts: dict[int, int], probs: np.ndarray, n: int) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` (token -> count of ``n`` draws) against ``probs``.

    Tokens expected at least 5 times are bins of their own; the rest share one bin, merged
    into the smallest bin if it is itself expected fewer than 5 times. A token drawn where
    the probability is 0 makes the statistic infinite. Returns (statistic, degrees of freedom).
    """
    expected = n * probs
    if any(c and expected[t] == 0 for t, c in counts.items()):
        return math.inf, 0
    big = [t for t in range(probs.size) if expected[t] >= 5]
    bins = [([t], expected[t]) for t in big]
    rest = [t for t in range(probs.size) if expected[t] < 5]
    e_rest = float(sum(expected[t] for t in rest))
    if e_rest >= 5 or not bins:
        bins.append((rest, e_rest))
    elif rest:
        i = min(range(len(bins)), key=lambda b: bins[b][1])
        bins[i] = (bins[i][0] + rest, bins[i][1] + e_rest)
    stat = 0.0
    for toks, e in bins:
        o = sum(counts.get(t, 0) for t in toks)
        stat += (o - e) ** 2 / e
    return stat, len(bins) - 1


def chi2_threshold(df: int, alpha: float = ALPHA) -> float:
    from scipy.stats import chi2  # scipy is a dependency of jax

    return float(chi2.isf(alpha, df))


# Two configurations on two disjoint sets of 16 one-token prompts, 32 seeds per prompt (requests
# with the same prompt are admitted one per step: each step runs one request of every prompt).
# Each names the wrong distributions its samples must be told from: a wrong temperature, or a
# truncation left out. The power of those rejections at ALPHA (non-central chi-square, its
# noncentrality from the reference distributions, computed when the test was written): for
# T=1 samples, about 0.9999 against T=0.7 and 1.0 against T=1.4; for the truncated samples,
# 1.0 against no truncation, 0.999 against top_k alone and 0.996 against top_p alone.
PER_PROMPT = 32
CONFIGS = {  # name: ((temperature, top_k, top_p), prompts, wrong (temperature, top_k, top_p))
    "T=1": ((1.0, 0, 1.0), [[[11 + 7 * j]] for j in range(16)], [(0.7, 0, 1.0), (1.4, 0, 1.0)]),
    "T=0.7,k=4,p=0.7": (
        (0.7, 4, 0.7),
        [[[300 + 5 * j]] for j in range(16)],
        [(0.7, 0, 1.0), (0.7, 4, 1.0), (0.7, 0, 0.7)],
    ),
}


def boundary_margin(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> float:
    """How far the reference logits are from flipping a top-k or top-p decision (the engine's
    logits differ from the dense reference's by float rounding)."""
    z = np.sort(logits / temperature)[::-1]
    margin = math.inf
    if 0 < top_k < z.size:
        margin = z[top_k - 1] - z[top_k]
    if top_p < 1.0:
        p = naive_probs(logits, temperature, top_k, 1.0)
        cum = np.cumsum(np.sort(p)[::-1])
        margin = min(margin, float(np.min(np.abs(cum - top_p))))
    return margin


def test_first_token_follows_the_reference_softmax(sharp, engine):
    """The pooled chi-square over the prompts of each configuration stays under its 1 - ALPHA
    quantile; the same counts against each wrong distribution exceed theirs."""
    from akv_jax.cache.ops import parse_history

    _, dm = sharp
    batches = []
    for i in range(PER_PROMPT):
        batch = []
        for c, (params, prompts, _) in enumerate(CONFIGS.values()):
            t, k, p = params
            for j, prompt in enumerate(prompts):
                seed = 10_000 * c + 100 * i + j
                rid = f"{c}/{j}/{i}"
                batch.append(request(rid, prompt, 1, seed, temperature=t, top_p=p, top_k=k))
        batches.append(batch)
    out = _drive_together(engine, batches)
    for c, (name, (params, prompts, wrong)) in enumerate(CONFIGS.items()):
        stat = {d: 0.0 for d in (params, *wrong)}
        df = {d: 0 for d in stat}
        for j, prompt in enumerate(prompts):
            logits, _ = dm.run(prompt, parse_history(None, 1))
            ref = np.asarray(logits[-1], np.float64)
            assert boundary_margin(ref, *params) > 1e-3, (name, j)
            support = naive_probs(ref, *params) > 0
            counts: dict[int, int] = {}
            for i in range(PER_PROMPT):
                (tok,), _ = out[f"{c}/{j}/{i}"]
                assert support[tok], (name, j, i, tok)  # never a token the truncation cut
                counts[tok] = counts.get(tok, 0) + 1
            for d in stat:
                s, n = chi_square(counts, naive_probs(ref, *d), PER_PROMPT)
                stat[d] += s
                df[d] += n
        # the bins are meaningful: two or more per prompt on average (fixed by the reference)
        assert df[params] >= len(prompts), (name, df)
        assert stat[params] < chi2_threshold(df[params]), (name, stat, df)
        for d in wrong:
            assert stat[d] > chi2_threshold(max(df[d], 1)), (name, d, stat, df)


def _drive_together(engine, batches):
    """Like :func:`drive`, but each batch is added while the previous one still runs."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    pending = list(batches)
    while pending or engine.has_work():
        if pending:
            for req in pending.pop(0):
                engine.add_request(req)
                out[req.rid] = ([], [])
        for ev in engine.step():
            if ev.token_id >= 0:
                out[ev.rid][0].append(ev.token_id)
                out[ev.rid][1].append(ev.logprob)
    return out


def test_engine_check_names_bad_sampling_fields(engine):
    """Callers of the engine itself (not through the API's parser) get the same 400 fields."""
    from akv_jax.errors import InvalidField

    for kw, field in [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                      ({"top_k": -1}, "top_k"), ({"seed": "7"}, "seed"), ({"seed": 1.0}, "seed")]:
        req = request("bad", [[1, 2]], 2)
        req.sampling = dataclasses.replace(req.sampling, **kw)
        with pytest.raises(InvalidField) as e:
            engine.check(req)
        assert e.value.field == f"sampling_params.{field}"
    engine.check(request("ok", [[1, 2]], 2, seed=-5, temperature=0.0, top_p=1e-9, top_k=10**9))


# --------------------------------------------------------------------------- 3. seeds

N_SEEDED = 20
SEEDED = [[5, 6, 7, 8, 9, 10], [40, 41, 42]]


def others(rng: np.random.Generator, tag: str, n: int):
    """Random requests to run beside the seeded one: some share its first segment, some have
    drops and repositions, temperatures from greedy to 1.5, seeded and not."""
    reqs = []
    for i in range(n):
        segs = [SEEDED[0]] if i % 2 == 0 else []
        for _ in range(int(rng.integers(1, 4))):
            segs.append(rng.integers(0, 500, size=int(rng.integers(1, 12))).tolist())
        cache = {"drop": {str(len(segs) - 1): [0]}, "reposition": [len(segs) - 1]} if (
            i % 3 == 2) else None
        seed = int(rng.integers(2**31)) if i % 4 else None
        reqs.append(request(
            f"{tag}{i}", segs, int(rng.integers(1, 30)), seed,
            temperature=float(rng.choice([0.0, 0.5, 1.0, 1.5])),
            top_p=float(rng.choice([1.0, 0.8])), top_k=int(rng.choice([0, 5])), cache=cache,
        ))
    return reqs


@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.8, 6, 0.9)])
def test_seeded_request_is_independent_of_what_runs_beside_it(sharp, engine, params):
    _, dm = sharp
    t, k, p = params

    def seeded(rid, seed=1234):
        return request(rid, SEEDED, N_SEEDED, seed, temperature=t, top_p=p, top_k=k)

    rng = np.random.default_rng(5)
    eng = engine
    alone = drive(eng, [[seeded("alone")]])["alone"]
    assert len(alone[0]) == N_SEEDED
    # in the same steps as 7 others (added first, so they are admitted with it), then after 7
    # more have run and filled the cache with shared prefixes, then first beside 3 others
    beside = drive(eng, [[*others(rng, "a", 7), seeded("beside")]])["beside"]
    after = drive(eng, [others(rng, "b", 7), [seeded("after")]])["after"]
    first = drive(eng, [[seeded("first"), *others(rng, "c", 3)]])["first"]
    for got in (beside, after, first):
        assert got[0] == alone[0]
        np.testing.assert_allclose(got[1], alone[1], atol=1e-4)
    # the draws are the sampler's, one per token from the request's own generator: replaying
    # the dense reference's logits for these tokens gives them back
    from akv_jax.cache.ops import parse_history

    g = make_rng(1234)
    logits, state = dm.run(SEEDED, parse_history(None, len(SEEDED)))
    replay = []
    for i in range(N_SEEDED):
        tok, lp = sample(np.asarray(logits[-1]), SP(t, p, k), g)
        replay.append(tok)
        assert lp == pytest.approx(alone[1][i], abs=1e-4)
        if i < N_SEEDED - 1:
            logits, state = dm.append(state, [alone[0][i]])
    assert replay == alone[0]
    # other seeds give other sequences; no seed still samples
    seeds = (1, 2, 3, -1)
    seqs = drive(eng, [[seeded(f"s{s}", s) for s in seeds] + [seeded(f"u{i}", None)
                                                             for i in range(2)]])
    distinct = {tuple(seqs[f"s{s}"][0]) for s in seeds} | {tuple(alone[0])}
    assert len(distinct) == 5
    assert len(seqs["u0"][0]) == len(seqs["u1"][0]) == N_SEEDED
    # two unseeded runs draw fresh entropy (the chance they agree here is below 1e-5)
    assert seqs["u0"][0] != seqs["u1"][0]


# --------------------------------------------------------------------------- 4. HTTP


@contextlib.contextmanager
def serving(engine):
    """The real app in-process over the module's engine; its thread runs only inside."""
    from fastapi.testclient import TestClient

    from akv_jax.model.tokenizer import ChatTokenizer
    from akv_jax.serving.api import create_app
    from akv_jax.serving.async_engine import AsyncEngine

    cfg = engine.cfg
    app = create_app(
        AsyncEngine(engine), "sharp", ChatTokenizer.byte_level_chatml(cfg.vocab_size),
        vocab_size=cfg.vocab_size, max_position=cfg.max_position_embeddings,
        stop_ids=tuple(cfg.eos_token_ids),
    )
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


GEN_SP = {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.95, "top_k": 3, "seed": 77,
          "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12,
        "temperature": 0.9, "top_p": 0.95, "top_k": 20, "seed": 77, "logprobs": True}


def test_http_same_seed_same_output(engine):
    with serving(engine) as client:
        first, top_k_off = _http_same_seed_same_output(client)
    # with the engine thread stopped, drive the engine directly: what the HTTP layer asked for
    # is exactly these sampling parameters
    direct = drive(engine, [[request("d", SEEDED, 12, 77, temperature=0.9, top_p=0.95,
                                     top_k=3)]])["d"]
    assert direct[0] == first[0]
    np.testing.assert_allclose(direct[1], first[1], atol=1e-4)
    unk = drive(engine, [[request("e", SEEDED, 12, 77, temperature=0.9, top_p=0.95)]])["e"]
    assert unk[0] == top_k_off[0] != first[0]


def _http_same_seed_same_output(client):
    def gen(**sp):
        r = client.post("/generate", json={"input_ids": SEEDED, "return_logprob": True,
                                           "sampling_params": {**GEN_SP, **sp}})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"], r.json()["output_token_logprobs"]

    first = gen()
    assert len(first[0]) == 12
    assert gen() == first
    with client.stream("POST", "/generate", json={
            "input_ids": SEEDED, "sampling_params": GEN_SP, "stream": True}) as resp:
        events = sse_events(resp.iter_lines())
    assert [t for e in events[:-1] for t in e["output_ids"]] == first[0]
    assert gen(seed=78)[0] != first[0]
    assert gen(seed=-77) == gen(seed=-77) != first  # any int64 seed (numpy refuses < 0)
    top_k_off = gen(top_k=-1)  # -1 is "off", as 0
    assert top_k_off == gen(top_k=0)

    def chat(**kw):
        r = client.post("/v1/chat/completions", json={**CHAT, **kw})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], [x["logprob"] for x in choice["logprobs"]["content"]]

    reply = chat()
    assert reply[0] and chat() == reply
    assert chat(seed=78) != reply
    assert chat(top_k=2) != reply  # the extension reaches the sampler
    return first, top_k_off


BAD = [
    ("temperature", -0.5), ("temperature", 100.5), ("temperature", "hot"), ("temperature", True),
    ("top_p", 0), ("top_p", -0.1), ("top_p", 1.5), ("top_p", "all"), ("top_k", -2),
    ("top_k", 2.5), ("top_k", "many"), ("seed", "x"), ("seed", 1.5), ("seed", 2**63),
    ("seed", -(2**63) - 1), ("seed", False),
]


def test_http_bad_sampling_values_are_400_naming_the_field(engine):
    with serving(engine) as client:
        _bad_values(client)


def _bad_values(client):
    for field, value in BAD:
        r = client.post("/generate", json={"input_ids": [1, 2],
                                           "sampling_params": {field: value}})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == f"sampling_params.{field}", (field, value)
        r = client.post("/v1/chat/completions", json={**CHAT, field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert r.json()["error"]["param"] == field, (field, value)
    # the edges that are valid
    for field, value in [("temperature", 0), ("temperature", 100), ("top_p", 1), ("top_k", -1),
                         ("top_k", 10**9), ("seed", -(2**63)), ("seed", 2**63 - 1)]:
        r = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {
            field: value, "max_new_tokens": 2}})
        assert r.status_code == 200, (field, value, r.text)
