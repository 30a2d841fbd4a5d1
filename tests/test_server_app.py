"""The HTTP layer in-process over a scripted stand-in engine: fault paths the real engine cannot
be made to hit on demand (engine errors, aborts), stop strings with known text, and auth."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from server_support import sse_events

from akv_jax.agent.launch import metric_samples
from akv_jax.cache.ops import CacheOpError
from akv_jax.model.tokenizer import ChatTokenizer
from akv_jax.serving.api import create_app
from akv_jax.serving.types import GenerateRequest, TokenEvent

TOK = ChatTokenizer.byte_level_chatml(512)
EOS = 511  # <|im_end|>
REPLY = "hello END world"


class ScriptedEngine:
    """What the API needs of ``Engine``: prepare, stats, flush_cache."""

    def __init__(self):
        self.flushes = 0
        self.busy = False

    def prepare(self, req: GenerateRequest) -> GenerateRequest:
        first = req.segments[0][0]
        if first == 13:
            raise KeyError("unexpected engine bug")
        if first == 14:
            raise CacheOpError("cache.reposition", "context reaches position 9999: add a "
                                                   "reposition")
        return req

    def stats(self) -> dict:
        return {"cache_queries": 3, "cache_query_tokens": 40, "cache_hit_tokens": 10,
                "pool_used_pages": 2, "pool_total_pages": 8, "evictions": 1, "restores": 0,
                "running": 0, "waiting": 0, "restored_tokens": 5, "note": "text is skipped"}

    def flush_cache(self) -> bool:
        if self.busy:
            return False
        self.flushes += 1
        return True


class ScriptedAsyncEngine:
    """Replies by the request's first token id: 1 three tokens, 2 an engine error after one
    token, 3 an abort whose final event restates the last token, anything else ``REPLY``
    followed by EOS."""

    def __init__(self):
        self.engine = ScriptedEngine()
        self.running = False
        self.closed: list[str] = []

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False

    def call(self, fn, *args):
        return fn(self.engine, *args)

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    async def generate(self, req: GenerateRequest):
        self.engine.prepare(req)
        first = req.segments[0][0]
        n_prompt = sum(map(len, req.segments))
        lp = -0.5 if req.return_logprob else None
        try:
            if first == 2:
                yield TokenEvent(req.rid, 7, lp, False, None, {})
                raise RuntimeError("engine error: device lost")
            if first == 3:
                yield TokenEvent(req.rid, 5, lp, False, None, {})
                yield TokenEvent(req.rid, 6, lp, False, None, {})
                yield TokenEvent(req.rid, 6, None, True, "abort", _meta(n_prompt, 2, "abort"))
                return
            ids = [5, 6, 7] if first == 1 else [*TOK.encode(REPLY), EOS]
            ids = ids[: req.sampling.max_new_tokens]
            for i, t in enumerate(ids):
                last = i == len(ids) - 1
                reason = ("stop" if t == EOS else "length") if last else None
                meta = _meta(n_prompt, len(ids), reason) if last else {}
                yield TokenEvent(req.rid, t, lp, last, reason, meta)
        finally:
            self.closed.append(req.rid)


def _meta(prompt: int, n: int, reason: str | None) -> dict:
    return {"prompt_tokens": prompt, "cached_tokens": 4, "active_tokens": prompt + n,
            "completion_tokens": n, "finish_reason": reason}


@pytest.fixture
def app_client():
    engine = ScriptedAsyncEngine()
    app = create_app(engine, "scripted", TOK, vocab_size=512, max_position=64, stop_ids=(EOS,))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert engine.running  # the app's lifespan starts the engine thread
        yield client, engine
    assert not engine.running


def test_generate_response_shape(app_client):
    client, _ = app_client
    r = client.post("/generate", json={"input_ids": [[1, 9], [9]], "return_logprob": True})
    assert r.status_code == 200
    body = r.json()
    assert body["output_ids"] == [5, 6, 7]
    assert body["output_token_logprobs"] == [-0.5, -0.5, -0.5]
    assert body["text"] == TOK.decode([5, 6, 7])
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == 3 and meta["cached_tokens"] == 4
    assert meta["active_tokens"] == 6 and meta["completion_tokens"] == 3
    assert meta["finish_reason"] == "length" and len(meta["id"]) == 32
    no_lp = client.post("/generate", json={"input_ids": [1, 9]}).json()
    assert "output_token_logprobs" not in no_lp


def test_engine_error_is_a_json_500_and_the_server_keeps_serving(app_client):
    client, engine = app_client
    r = client.post("/generate", json={"input_ids": [2, 9]})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "device lost" in r.json()["error"]["message"]
    assert "Traceback" not in r.text
    r = client.post("/generate", json={"input_ids": [13, 9]})  # a bug in check()
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal server error", "type": "server_error",
                                  "param": None, "code": None}}
    assert client.post("/generate", json={"input_ids": [1, 9]}).status_code == 200


def test_engine_validation_errors_are_400(app_client):
    client, _ = app_client
    r = client.post("/generate", json={"input_ids": [14, 9]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "cache.reposition"
    assert "add a reposition" in r.json()["error"]["message"]


def test_stream_engine_error_ends_with_an_error_event(app_client):
    client, engine = app_client
    with client.stream("POST", "/generate", json={"input_ids": [2], "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[0]["output_ids"] == [7]
    assert events[1]["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]"


def test_final_event_restating_a_token_is_not_counted_twice(app_client):
    client, _ = app_client
    body = client.post("/generate", json={"input_ids": [3, 1]}).json()
    assert body["output_ids"] == [5, 6]
    assert body["meta_info"]["finish_reason"] == "abort"
    assert body["meta_info"]["completion_tokens"] == 2


def test_chat_strips_eos_and_reports_usage(app_client):
    client, _ = app_client
    r = client.post("/v1/chat/completions", json={
        "model": "scripted", "messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "scripted"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop"
    assert "".join(x["token"] for x in choice["logprobs"]["content"]) == REPLY
    prompt = sum(map(len, TOK.encode_messages([{"role": "user", "content": "hi"}], True)))
    assert body["usage"] == {
        "prompt_tokens": prompt, "completion_tokens": len(REPLY) + 1,
        "total_tokens": prompt + len(REPLY) + 1, "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_chat_stop_string_truncates_and_aborts(app_client):
    client, engine = app_client
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}],
            "stop": [" END"]}
    r = client.post("/v1/chat/completions", json=body).json()
    assert r["id"].removeprefix("chatcmpl-") in engine.closed  # closed (aborted) at once
    assert r["choices"][0]["message"]["content"] == "hello"
    assert r["choices"][0]["finish_reason"] == "stop"
    # the engine stream was closed after " END" (6 + 4 tokens), not run to the end
    assert r["usage"]["completion_tokens"] == len("hello END")
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # no final meta arrived
    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True,
                             "stream_options": {"include_usage": True}}) as resp:
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_default_max_tokens_is_clipped_to_the_positions_left(app_client):
    client, _ = app_client
    msgs = [{"role": "user", "content": "x" * 42}]
    prompt = sum(map(len, TOK.encode_messages(msgs, True)))  # 42 + 19 template tokens
    r = client.post("/v1/chat/completions", json={"messages": msgs}).json()
    # max_position 64 leaves 64 - 61 = 3 tokens: the reply is cut at 3
    assert r["usage"]["completion_tokens"] == 64 - prompt == 3
    assert r["choices"][0]["finish_reason"] == "length"


def test_chat_without_template_is_400():
    app = create_app(ScriptedAsyncEngine(), "raw", None, vocab_size=512)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions",
                        json={"model": "raw", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages"
        assert "model has no chat template" in r.json()["error"]["message"]
        assert client.post("/generate", json={"input_ids": [1]}).status_code == 200


def test_unknown_route_and_method_are_json(app_client):
    client, _ = app_client
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = client.get("/generate")
    assert r.status_code == 405 and "error" in r.json()


def test_flush_cache(app_client):
    client, engine = app_client
    assert client.post("/flush_cache").json() == {"flushed": True}
    assert engine.engine.flushes == 1
    engine.engine.busy = True
    r = client.post("/flush_cache")
    assert r.status_code == 409 and "requests are running" in r.json()["error"]["message"]


def test_metrics_text(app_client):
    client, _ = app_client
    client.post("/generate", json={"input_ids": [1, 9]})
    text = client.get("/metrics").text
    want = {
        "akv_cache_queries_total": 3.0,
        "akv_cache_query_tokens_total": 40.0,
        "akv_cache_hit_tokens_total": 10.0,
        "akv_cache_hit_rate": 0.25,
        "akv_kv_pool_used_pages": 2.0,
        "akv_kv_pool_total_pages": 8.0,
        "akv_kv_pool_usage": 0.25,
        "akv_cache_evictions_total": 1.0,
        "akv_cache_restores_total": 0.0,
        "akv_cache_restored_tokens_total": 5.0,
        "akv_num_running_requests": 0.0,
        "akv_num_waiting_requests": 0.0,
        'akv_http_requests_total{method="POST",path="/generate",status="200"}': 1.0,
        'akv_request_latency_seconds_count{endpoint="generate"}': 1.0,
        'akv_time_to_first_token_seconds_count{endpoint="generate"}': 1.0,
        'akv_requests_finished_total{endpoint="generate",finish_reason="length"}': 1.0,
        "akv_prompt_tokens_total": 2.0,
        "akv_generation_tokens_total": 3.0,
        "akv_cached_prompt_tokens_total": 4.0,
    }
    got = metric_samples(text)
    assert {k: got.get(k) for k in want} == want
    assert "note" not in text


def test_api_key():
    app = create_app(ScriptedAsyncEngine(), "scripted", TOK, api_key="s3cret", vocab_size=512)
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        # the API's description is public too (it holds no data)
        assert client.get("/openapi.json").status_code == 200
        assert client.get("/docs").status_code == 200
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/generate"), ("POST", "/flush_cache"),
                             ("POST", "/v1/chat/completions"), ("GET", "/nope")]:
            for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}]:
                r = client.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                assert r.json()["error"]["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == "scripted"
        r = client.post("/generate", headers=ok, json={"input_ids": [1]})
        assert r.status_code == 200
        assert client.get("/nope", headers=ok).status_code == 404


def test_oversized_body_is_413():
    from akv_jax.serving.protocol import Limits

    app = create_app(ScriptedAsyncEngine(), "s", TOK, limits=Limits(max_body_bytes=100))
    big = json.dumps({"input_ids": [1] * 100}).encode()

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield big[:60]
        yield big[60:]

    with TestClient(app) as client:
        for path in ("/generate", "/v1/chat/completions"):
            for body in (big, chunked()):  # a declared length over the limit, then chunks
                r = client.post(path, content=body)
                assert r.status_code == 413, (path, r.text)
                assert r.json() == {"error": {
                    "message": "body: request body exceeds the limit of 100 bytes",
                    "type": "invalid_request_error", "param": "body", "code": None}}
        # a body under the limit is read and answered as usual
        ok = json.dumps({"input_ids": [1, 9]}).encode()
        assert len(ok) <= 100
        assert client.post("/generate", content=ok).status_code == 200


def test_openapi_document_lists_the_request_bodies(app_client):
    client, _ = app_client
    r = client.get("/docs")
    assert r.status_code == 200 and "swagger-ui" in r.text and "/openapi.json" in r.text
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    components = doc["components"]["schemas"]
    for path, model in [("/generate", "GenerateBody"), ("/v1/chat/completions", "ChatBody")]:
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}
    gen = components["GenerateBody"]
    assert gen["required"] == ["input_ids"]
    assert {"input_ids", "cache", "sampling_params", "return_logprob", "stream"} == set(
        gen["properties"])
    # bounds are JSON-schema keywords (not pydantic's own names)
    assert {"minimum": 1, "type": "integer"} in (
        components["SamplingBody"]["properties"]["max_new_tokens"]["anyOf"])
    assert {"messages", "cache", "max_tokens", "stop", "top_k"} <= set(
        components["ChatBody"]["properties"])
    assert "role" in components["Message"]["properties"]

    def refs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from [v] if k == "$ref" else refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    found = set(refs(doc))
    assert "#/components/schemas/Message" in found
    for ref in found:  # every reference resolves within the document
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in components
