"""/generate, validation, /metrics and /flush_cache against a real server on the tiny model.

The server is ``python -m akv_jax.serving.main --model-path tiny`` in a subprocess (shared
with test_server_openai.py). Prompts reuse a few token lists so that the engine compiles few
shapes: most of this file's time is XLA compiles on the CPU.
"""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest
from server_support import metric_value, shared_server, sse_events

from akv_jax.agent.launch import metric_samples

A = list(range(10, 50))  # 40 tokens
B = list(range(60, 68))  # 8
C = [70, 71, 72]
GREEDY4 = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
DROP_B_REPOS = {"drop": {"2": [1]}, "reposition": [2]}


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


def generate(client: httpx.Client, body: dict) -> dict:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_health_and_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 4096


def test_generate_basic(client):
    out = generate(client, {"input_ids": [A, B], "sampling_params": GREEDY4})
    ids = out["output_ids"]
    assert len(ids) == 4 and all(0 <= t < 512 for t in ids)
    assert "output_token_logprobs" not in out
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 48
    assert meta["completion_tokens"] == 4
    assert meta["active_tokens"] == 52  # nothing dropped: prompt + generated
    assert meta["finish_reason"] == "length"
    # greedy is deterministic, and a flat list is one segment (segments matter only to ops)
    assert generate(client, {"input_ids": [A, B], "sampling_params": GREEDY4})["output_ids"] == ids
    assert generate(client, {"input_ids": A + B, "sampling_params": GREEDY4})["output_ids"] == ids


def test_generate_with_ops_and_logprobs_same_after_flush(client):
    body = {"input_ids": [A, B, C], "cache": DROP_B_REPOS, "sampling_params": GREEDY4,
            "return_logprob": True}
    first = generate(client, body)
    resident = generate(client, body)
    assert resident["meta_info"]["cached_tokens"] == 48  # all but C, recomputed for logits
    assert client.post("/flush_cache").json() == {"flushed": True}
    fresh = generate(client, body)
    assert fresh["meta_info"]["cached_tokens"] == 0
    for out in (first, resident, fresh):
        assert out["meta_info"]["active_tokens"] == 40 + 3 + 4  # B dropped
        assert len(out["output_token_logprobs"]) == 4
        assert all(lp < 0 for lp in out["output_token_logprobs"])
    # DESIGN §2: the result never depends on what the server holds
    assert first["output_ids"] == resident["output_ids"] == fresh["output_ids"]
    np.testing.assert_allclose(resident["output_token_logprobs"],
                               fresh["output_token_logprobs"], atol=1e-4)
    # the ops change the result: without the drop/repos C attends to B
    plain = generate(client, {**body, "cache": None})
    assert plain["meta_info"]["active_tokens"] == 51 + 4
    assert plain["output_token_logprobs"] != fresh["output_token_logprobs"]


def test_generate_stream(client):
    body = {"input_ids": [A, B], "sampling_params": GREEDY4, "return_logprob": True}
    whole = generate(client, body)
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 4  # one event per token
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    np.testing.assert_allclose([lp for c in chunks for lp in c["output_token_logprobs"]],
                               whole["output_token_logprobs"], atol=1e-4)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"] == "length" and final["completion_tokens"] == 4
    assert final["prompt_tokens"] == 48 and final["active_tokens"] == 52


LONG = list(range(100, 300)) * 10  # 2000 tokens


def invalid_cases() -> list[tuple[object, str, str]]:
    """(body, param, message fragment) for requests that must be answered with 400."""
    return [
        ("{not json", "body", "malformed JSON"),
        ("[1, 2]", "body", "expected a JSON object"),
        ({"input_ids": [[1, 2], [3]], "cache": {"drop": {"7": [0]}}},
         'cache.drop["7"]', "boundary 7 out of range [0, 2)"),
        ({"input_ids": [[1], [2], [3]], "cache": {"drop": {"1": [2]}}},
         'cache.drop["1"][0]', "segment 2 is dropped at boundary 1 before it exists"),
        ({"input_ids": [[1], [2], [3]], "cache": {"drop": {"1": [5]}}},
         'cache.drop["1"][0]', "segment 5 out of range [0, 3)"),
        ({"input_ids": [[1], [2], [3]], "cache": {"drop": {"1": [0], "2": [0]}}},
         'cache.drop["2"][0]', "segment 0 is dropped twice"),
        ({"input_ids": [[1], [2], [3]], "cache": {"reposition": [1, 2, 1]}},
         "cache.reposition[2]", "duplicate reposition boundary 1"),
        ({"input_ids": [[1], [2]], "cache": {"reposition": [0.5]}},
         "cache.reposition[0]", "expected an integer"),
        ({"input_ids": [[1], [2]], "cache": {"drop": {"x": [0]}}},
         'cache.drop["x"]', "expected an integer"),
        ({"input_ids": [[1], []]}, "input_ids[1]", "empty segment"),
        ({"input_ids": [[1], ["7"]]}, "input_ids[1][0]", "expected an integer token id"),
        ({"input_ids": [[1], [512]]}, "input_ids[1][0]", "token id 512 outside the vocabulary"),
        ({"input_ids": "hello"}, "input_ids", "expected a non-empty list"),
        ({"input_ids": [1], "cache": "drop"}, "cache", "expected an object"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 40000}},
         "sampling_params.max_new_tokens", "40000 exceeds the limit 32768"),
        ({"input_ids": [1], "sampling_params": {"temperature": [1]}},
         "sampling_params.temperature", "valid number, got [1]"),
        ({"input_ids": [1], "return_logprob": 1}, "return_logprob", "valid boolean, got 1"),
        ({"input_ids": [[1]] * 4097}, "input_ids", "4097 segments exceed the limit of 4096"),
        ({"input_ids": [0] * ((1 << 20) + 1)}, "input_ids", "1048577 prompt tokens exceed"),
        # 2000 + 2000 + 200 tokens: the last segment would sit at positions 4000..4199 > 4096
        ({"input_ids": [LONG, LONG, A * 5]}, "cache.reposition", "add a reposition"),
        ({"input_ids": [A], "sampling_params": {"max_new_tokens": 4090}},
         "cache.reposition", "past the model's limit of 4096"),
    ]


def test_invalid_requests_are_400_and_the_server_keeps_serving(client):
    for body, param, words in invalid_cases():
        if isinstance(body, str):
            r = client.post("/generate", content=body,
                            headers={"content-type": "application/json"})
        else:
            r = client.post("/generate", json=body)
        assert r.status_code == 400, (param, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param
        assert words in err["message"], (param, err["message"])
        assert err["message"].startswith(param + ": ")
    out = generate(client, {"input_ids": [A, B], "sampling_params": GREEDY4})
    assert out["meta_info"]["completion_tokens"] == 4


def test_a_reposition_brings_a_long_context_under_the_limit(client):
    # The request refused above is served once segment 0 is dropped and positions compacted.
    body = {"input_ids": [LONG, LONG, A * 5], "cache": {"drop": {"1": [0]}, "reposition": [1]},
            "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    meta = generate(client, body)["meta_info"]
    assert meta["prompt_tokens"] == 4200
    assert meta["active_tokens"] == 2000 + 200 + 2


def test_metrics_and_flush(client):
    before = client.get("/metrics").text
    generate(client, {"input_ids": [A, B], "sampling_params": GREEDY4})
    after = client.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    text = after.text
    names = {key.split("{")[0] for key in metric_samples(text)}
    for name in ["akv_cache_queries_total", "akv_cache_query_tokens_total",
                 "akv_cache_hit_tokens_total", "akv_cache_hit_rate", "akv_kv_pool_used_pages",
                 "akv_kv_pool_total_pages", "akv_kv_pool_usage", "akv_cache_evictions_total",
                 "akv_cache_restores_total", "akv_num_running_requests",
                 "akv_num_waiting_requests", "akv_http_requests_total",
                 "akv_request_latency_seconds_bucket", "akv_time_to_first_token_seconds_bucket",
                 "akv_generation_tokens_total", "akv_prompt_tokens_total"]:
        assert name in names, name
    assert metric_value(text, "akv_cache_queries_total") == (
        metric_value(before, "akv_cache_queries_total") + 1
    )
    assert metric_value(text, "akv_cache_query_tokens_total") == (
        metric_value(before, "akv_cache_query_tokens_total") + 48
    )
    assert metric_value(text, "akv_generation_tokens_total") == (
        metric_value(before, "akv_generation_tokens_total") + 4
    )
    assert metric_value(text, "akv_kv_pool_total_pages") == 16384 / 16
    assert metric_value(text, "akv_kv_pool_used_pages") > 0  # the request's KV stays cached
    assert metric_value(text, "akv_num_running_requests") == 0
    assert client.post("/flush_cache").json() == {"flushed": True}
    flushed = client.get("/metrics").text
    assert metric_value(flushed, "akv_kv_pool_used_pages") == 0
    assert metric_value(flushed, "akv_kv_pool_usage") == 0


def test_client_disconnect_aborts_the_request(server, client):
    body = {"input_ids": [A, B], "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.Client(base_url=server.url, timeout=60) as c2:
        with c2.stream("POST", "/generate", json=body) as r:
            first = next(r.iter_lines())
            assert json.loads(first[len("data: "):])["output_ids"]
    # Running to 3000 tokens would take far longer than this (and recompile as it grows).
    deadline = time.monotonic() + 10
    while True:
        text = client.get("/metrics").text
        busy = metric_value(text, "akv_num_running_requests") + metric_value(
            text, "akv_num_waiting_requests")
        if busy == 0:
            break
        assert time.monotonic() < deadline, "the disconnected request is still running"
        time.sleep(0.1)
    assert generate(client, {"input_ids": [A, B], "sampling_params": GREEDY4})
