"""``cache.removed_reasoning: "drop"`` served end to end, against the dense reference.

Turn 1: a tool call from the random Qwen3-MoE (``tiny-qwen3-moe``) through the real app, its
reasoning written within the budget. Turn 2 sends the call back *without* its reasoning (as
clients that strip ``reasoning_content`` do) with the option on. What is checked, each from
its own source:

* the request the engine gets: the assistant message as three segments whose ids are the
  ones turn 1 generated (captured from the engine's events), the middle one the ``<think>``
  block, dropped at the message's boundary, and the other two reading as the message the
  template renders without reasoning (the tokenizer's own rendering);
* the reply: the dense reference's greedy tokens and log-probabilities for that request
  (numpy, float64, the op semantics written from scratch), so the drop is exact;
* the cache: the whole first turn, reasoning included, is found (a hit, not a re-prefill).
"""

from __future__ import annotations

import pytest
from exactness import dense_greedy
from fastapi.testclient import TestClient

from akv_jax.cache.dense_reference import DenseModel
from akv_jax.serving.api import create_app
from akv_jax.serving.async_engine import AsyncEngine
from akv_jax.serving.engine import Engine
from akv_jax.serving.protocol import Limits
from converters.loading import load_model

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Search notes.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 6}},
                   "required": ["query"], "additionalProperties": False}}}]
MESSAGES = [{"role": "system", "content": "You are a notes agent."},
            {"role": "user", "content": "Find my notes on Paris."}]
N_NEW = 5


class RecordingEngine(AsyncEngine):
    """The app's engine, keeping each request and the ids generated for it."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.requests: list = []
        self.generated: list[list[int]] = []

    async def generate(self, req):
        self.requests.append(req)
        out: list[int] = []
        self.generated.append(out)
        async for ev in super().generate(req):
            if ev.token_id >= 0:
                out.append(ev.token_id)
            yield ev


@pytest.fixture(scope="module")
def served():
    model = load_model("tiny-qwen3-moe")
    engine = RecordingEngine(Engine(model, max_total_tokens=4096, page_size=8,
                                    attention_backend="reference"))
    cfg = model.cfg
    app = create_app(engine, "tiny-qwen3-moe", model.tokenizer, vocab_size=cfg.vocab_size,
                     max_position=cfg.max_position_embeddings,
                     stop_ids=tuple(cfg.eos_token_ids), arch=cfg.arch,
                     limits=Limits(reasoning_budget=6))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield model, engine, client


def post(client: TestClient, body: dict) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "m", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_reasoning_left_out_is_dropped_exactly(served):
    model, engine, client = served
    tok = model.tokenizer
    first = post(client, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                          "max_tokens": 160})
    msg = first["choices"][0]["message"]
    assert msg["tool_calls"] and msg.get("reasoning_content"), msg
    req1, gen1 = engine.requests[-1], engine.generated[-1]

    resent = {"role": "assistant", "content": None, "tool_calls": msg["tool_calls"]}
    messages = [*MESSAGES, resent,
                {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "none"}]
    second = post(client, {"messages": messages, "tools": TOOLS, "max_tokens": N_NEW,
                           "logprobs": True, "cache": {"removed_reasoning": "drop"}})
    req2 = engine.requests[-1]

    # The request: messages 0, 1, then the reply as pre, removed, post, the tool result and
    # the generation prompt; the removed segment dropped once its message is in.
    rendered = tok.encode_messages(messages, add_generation_prompt=True, tools=TOOLS)
    segs = req2.segments
    assert len(segs) == len(rendered) + 2
    assert segs[:2] == rendered[:2] and segs[5:] == rendered[3:]
    pre, removed, post_ = segs[2:5]
    generated = [*req1.segments[-1], *gen1]  # the generation prompt, then the reply
    assert [*pre, *removed, *post_][: len(generated) - 1] == generated[:-1]
    assert tok.decode(removed).startswith("<think>\n")
    assert tok.decode(removed).endswith("</think>\n\n")
    assert tok.decode([*pre, *post_]) == tok.decode(rendered[2])
    assert dict(req2.history.drops) == {4: (3,)} and not req2.history.repos

    # The reply: the dense reference's, token for token.
    want_toks, want_lps = dense_greedy(DenseModel(model.params, model.cfg), segs, req2.history,
                                       N_NEW)
    assert engine.generated[-1] == want_toks
    got_lps = [c["logprob"] for c in second["choices"][0]["logprobs"]["content"]]
    assert got_lps == pytest.approx(want_lps[: len(got_lps)], abs=1e-4)

    # The cache: turn 1's prompt and its reasoning at least (the reply opened the <think>
    # block right after the generation prompt, so ``pre`` is that prompt).
    assert pre == req1.segments[-1]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= sum(len(s) for s in req1.segments) + len(removed)
