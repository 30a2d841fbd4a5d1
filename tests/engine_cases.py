"""Serving-engine runs shared by several test files: random request sets sent to an
engine and checked against the dense reference (the engine-exactness, tensor-parallel
and multi-host tests), and the engine's greedy tokens for plain prompts (model parity)."""

from __future__ import annotations

import numpy as np
from exactness import dense_greedy as dense_generate
from exactness import run_requests

from akv_jax.cache.ops import add_random_ops, parse_history
from akv_jax.serving.engine import Engine
from akv_jax.serving.types import GenerateRequest, SamplingParams

N_NEW = 4  # tokens generated per request by run and checked by check


def random_requests(rng, count, vocab=500):
    """Fresh histories, plus multi-turn extensions (same prefix and ops, more segments)."""
    reqs = []
    for _ in range(count):
        if reqs and rng.random() < 0.4:
            segs, cache = reqs[int(rng.integers(len(reqs)))]
            segs = [list(s) for s in segs]
            cache = {"drop": dict(cache["drop"]), "reposition": list(cache["reposition"])}
        else:
            segs, cache = [], {"drop": {}, "reposition": []}
        dropped = {i for v in cache["drop"].values() for i in v}
        for _ in range(int(rng.integers(1, 5))):
            segs.append(rng.integers(0, vocab, size=int(rng.integers(1, 20))).tolist())
            s = len(segs) - 1
            add_random_ops(rng, cache, s, dropped, p_drop=0.2, p_repos=0.3)
        reqs.append((segs, cache))
    return reqs


def run(engine, reqs, concurrent):
    """``(tokens, logprobs, meta)`` per request, sent in order (one at a time or at once)."""
    return run_requests(engine, reqs, list(range(len(reqs))), concurrent, n=N_NEW)


def check(dm, reqs, results):
    """Each result equals the dense reference: tokens, log-probs (1e-4), prompt length."""
    for (segs, cache), (toks, lps, meta) in zip(reqs, results, strict=True):
        ref_toks, ref_lps = dense_generate(dm, segs, parse_history(cache, len(segs)), N_NEW)
        assert toks == ref_toks, (segs, cache)
        np.testing.assert_allclose(lps, ref_lps, atol=1e-4)
        assert meta["prompt_tokens"] == sum(map(len, segs))


def engine_greedy(
    model, prompts: list[list[int]], n: int, attention_backend: str = "auto"
) -> list[list[int]]:
    """Greedy tokens of the serving engine for ``prompts`` sent at once (decoded together)."""
    engine = Engine(
        model,
        max_total_tokens=sum(len(p) + n for p in prompts) + 256,
        attention_backend=attention_backend,
    )
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(str(i), [p], parse_history(None, 1), sp))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for ev in engine.step():
            assert ev.error is None, ev.error
            out[ev.rid].append(ev.token_id)
    return [out[str(i)] for i in range(len(prompts))]
