"""Constrained requests in the engine's batches, against the dense reference.

A grammar (llguidance, :mod:`akv_jax.formats.constraint`) only masks: where it leaves a
choice, a greedy constrained request takes the token the model itself ranks first among the
allowed ones, and where it forces tokens they are appended as written (jump-forward feeds
them in one pass; without it, a step each). The reference here runs the same grammar over the
dense model's logits (numpy, float64, :mod:`akv_jax.cache.dense_reference`): forced tokens
fed as they come, otherwise the masked row's first largest logit. Free requests with drops and
repositions share every batch with the constrained ones, and must get exactly the answers
they get alone, so a constraint never changes another request's answer.
"""

from __future__ import annotations

import numpy as np
import pytest
from exactness import LOGPROB_ATOL, MAX_STEPS, dense_answers, random_histories, tiny_dense_model

from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import OpHistory, parse_history
from akv_jax.formats.constraint import GrammarCompiler, TokenConstraint
from akv_jax.model.tokenizer import ChatTokenizer
from akv_jax.serving.engine import Engine
from akv_jax.serving.types import GenerateRequest, SamplingParams

N_FREE_TOKENS = 8
MAX_CONSTRAINED = 48
LOOKUP = {"type": "object",
          "properties": {"query": {"type": "string", "maxLength": 4},
                         "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["query", "limit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
         {"type": "function", "function": {"name": "noop", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def setup():
    model = tiny_dense_model()
    tok = ChatTokenizer.byte_level_chatml(model.cfg.vocab_size)
    return model, tok, DenseModel(model.params, model.cfg)


def constraints(tok: ChatTokenizer, width: int) -> list[TokenConstraint]:
    gc = GrammarCompiler(tok, width, "qwen3")
    return [gc.tool_calls(TOOLS, reasoning_budget=3),
            gc.tool_calls(TOOLS, names=["lookup"]),
            gc.json_document(LOOKUP)]


def dense_constrained(dm: DenseModel, segs: list, c: TokenConstraint, n: int,
                      jump_forward: bool) -> tuple:
    """The constrained greedy reply by the dense reference, step by step as the engine takes
    it: each step's logits give one token (the masked row's first largest, with the model's
    own log-probability), then with ``jump_forward`` the tokens the grammar forces after it
    are appended with none (no logits were computed for them)."""
    logits, st = dm.run(segs, OpHistory.empty(len(segs)))
    last = logits[-1]
    toks: list[int] = []
    lps: list[float | None] = []
    while True:
        t = int(np.argmax(np.where(c.allowed(), last, -np.inf)))
        lp = last - (np.log(np.exp(last - last.max()).sum()) + last.max())
        c.advance(t)
        new, lps = [t], [*lps, float(lp[t])]
        while jump_forward and not c.finished and len(toks) + len(new) < n:
            forced = c.forced()[: n - len(toks) - len(new)]
            if not forced:
                break
            for f in forced:
                c.advance(f)
                new.append(f)
                lps.append(None)
                if c.finished:
                    break
        toks += new
        if c.finished or len(toks) >= n:
            return toks, lps
        lg, st = dm.append(st, new)
        last = lg[-1]


@pytest.mark.parametrize("jump_forward", [True, False])
def test_constrained_and_free_requests_share_batches_exactly(setup, jump_forward):
    model, tok, dm = setup
    width = model.cfg.vocab_size
    rng = np.random.default_rng(5)
    free = random_histories(rng, 4, vocab=width)
    free_refs = dense_answers(dm, free, N_FREE_TOKENS)
    prompts = [tok.encode_messages(
        [{"role": "user", "content": f"Find note {i}."}], add_generation_prompt=True,
        tools=TOOLS) for i in range(3)]
    want = [dense_constrained(dm, p, c, MAX_CONSTRAINED, jump_forward)
            for p, c in zip(prompts, constraints(tok, width), strict=True)]
    assert any(lp is None for _, lps in want for lp in lps) == jump_forward

    engine = Engine(model, max_total_tokens=4096, page_size=8, attention_backend="reference",
                    jump_forward=jump_forward)
    for i, (segs, cache) in enumerate(free):
        sp = SamplingParams(max_new_tokens=N_FREE_TOKENS, ignore_eos=True)
        engine.add_request(GenerateRequest(f"free{i}", segs, parse_history(cache, len(segs)),
                                           sp, True))
    for i, (p, c) in enumerate(zip(prompts, constraints(tok, width), strict=True)):
        sp = SamplingParams(max_new_tokens=MAX_CONSTRAINED)
        engine.add_request(GenerateRequest(f"c{i}", p, OpHistory.empty(len(p)), sp, True, c))
    got: dict[str, tuple[list, list]] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            break
        for ev in engine.step():
            toks, lps = got.setdefault(ev.rid, ([], []))
            if ev.token_id >= 0:
                toks.append(ev.token_id)
                lps.append(ev.logprob)
    for i, (toks, lps) in enumerate(free_refs):
        g_toks, g_lps = got[f"free{i}"]
        assert g_toks == toks, f"free request {i} changed"
        np.testing.assert_allclose(g_lps, lps, atol=LOGPROB_ATOL)
    for i, (toks, lps) in enumerate(want):
        g_toks, g_lps = got[f"c{i}"]
        assert g_toks == toks, f"constrained request {i}: {tok.decode(g_toks)!r}"
        for g, w in zip(g_lps, lps, strict=True):
            if w is None:
                assert g is None or np.isnan(g)
            else:
                assert abs(g - w) <= LOGPROB_ATOL


def test_masked_greedy_is_the_masked_rows_argmax():
    """The device's masked argmax against numpy: llguidance's bit layout, a vocabulary that
    is not a multiple of 32, ties (the first index wins), the unmasked log-softmax."""
    import jax.numpy as jnp

    from akv_jax.serving.device_group import masked_greedy

    rng = np.random.default_rng(0)
    R, V = 5, 100
    logits = rng.integers(-3, 3, size=(R, V)).astype(np.float32)  # many ties
    rows = np.array([4, 0, 2, 2], np.int32)
    allowed = rng.random((len(rows), V)) < 0.3
    allowed[:, 97] = True  # an id in the last, partial word
    bits = np.zeros((len(rows), (V + 31) // 32), np.uint32)
    for k, i in zip(*np.nonzero(allowed), strict=True):
        bits[k, i // 32] |= np.uint32(1) << np.uint32(i % 32)
    tok, lp = masked_greedy(jnp.asarray(logits), jnp.asarray(rows),
                            jnp.asarray(bits.view(np.int32)))
    for k, r in enumerate(rows):
        x = logits[r].astype(np.float64)
        want = int(np.argmax(np.where(allowed[k], x, -np.inf)))
        assert int(tok[k]) == want
        lse = x.max() + np.log(np.exp(x - x.max()).sum())
        assert float(lp[k]) == pytest.approx(x[want] - lse, abs=1e-5)
