"""The Responses API translation (no engine, no server): requests to chat bodies, replies to
Response objects and server-sent events.

The oracle is OpenAI's own client. Its typed models validate every Response and every event;
driven through an ``httpx.MockTransport`` that does what the route will do (parse with
ResponsesBody, translate with to_chat, answer a scripted reply), it assembles the streamed
events itself, and that must equal the plain answer and the script. The chat side is checked
against OpenAI's chat request types and our own chat body model.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.chat import completion_create_params
from openai.types.responses import Response, ResponseStreamEvent

from akv_jax.errors import InvalidField
from akv_jax.serving.body_validation import validated
from akv_jax.serving.chat_body import ChatBody
from akv_jax.serving.protocol import Limits
from akv_jax.serving.responses_body import ResponsesBody
from akv_jax.serving.responses_output import ResponseEvents, ToolCall, Usage, response_object
from akv_jax.serving.responses_to_chat import ChatTranslation, to_chat

MODEL = "akv-test-model"
RID = "resp_0123abcd"
CREATED = 1_760_000_000

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
CHAT_REQUEST = {
    False: pydantic.TypeAdapter(completion_create_params.CompletionCreateParamsNonStreaming),
    True: pydantic.TypeAdapter(completion_create_params.CompletionCreateParamsStreaming),
}

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]},
           "strict": True}
CLOCK = {"type": "function", "name": "get_time", "description": None,
         "parameters": {"type": "object", "properties": {}}, "strict": None}


@dataclasses.dataclass
class Script:
    """What the fake engine replies, at chat level."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    finish: str = "stop"
    usage: Usage = Usage(input_tokens=57, output_tokens=31, cached_tokens=16,
                         reasoning_tokens=9)


CALLING = Script(
    reasoning="The user wants weather in two cities. I'll call the tool twice.",
    content="Let me check both cities.",
    calls=[("call_a1", "get_weather", '{"city": "Paris"}'),
           ("call_b2", "get_weather", '{"city":"Zürich"}')],
    finish="tool_calls",
)
SCRIPTS = {
    "calls": CALLING,
    "content_only": Script(content="Héllo, wörld! 🌍 Two\nlines."),
    "reasoning_and_content": Script(reasoning="2+2 is 4.", content="4"),
    "calls_only": Script(calls=[("call_x", "get_time", "{}")], finish="tool_calls"),
    "length_cut": Script(reasoning="thinking a lot", content="The answer is", finish="length"),
}


def pieces(text: str) -> list[str]:
    """``text`` in pieces of varying sizes, as a detokenizer would hand them out."""
    out, i = [], 0
    for size in itertools.cycle((1, 4, 2, 7, 3)):
        if i >= len(text):
            return out
        out.append(text[i:i + size])
        i += size
    raise AssertionError("unreachable")


def stream_reply(body: ResponsesBody, script: Script) -> list[str]:
    ev = ResponseEvents(body, model=MODEL, response_id=RID, created_at=CREATED)
    out = ev.start()
    for p in pieces(script.reasoning):
        out += ev.reasoning(p)
    for p in pieces(script.content):
        out += ev.content(p)
    for i, (call_id, name, args) in enumerate(script.calls):
        for k, p in enumerate(pieces(args) or [""]):
            out += ev.tool_call(i, call_id if k == 0 else None, name if k == 0 else None, p)
    return out + ev.finish(script.finish, script.usage)


def plain_reply(body: ResponsesBody, script: Script) -> dict[str, Any]:
    return response_object(body, reasoning=script.reasoning, content=script.content,
                           tool_calls=script.calls, finish_reason=script.finish,
                           usage=script.usage, model=MODEL, response_id=RID,
                           created_at=CREATED)


class FakeServer:
    """What the route does, minus the engine: parse, translate, answer the scripted reply."""

    def __init__(self, script: Script):
        self.script = script
        self.seen: list[ChatTranslation] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/responses"
        try:
            body = validated(ResponsesBody, json.loads(request.content))
            tr = to_chat(body)
        except InvalidField as e:
            return httpx.Response(400, json={"error": {
                "message": str(e), "type": "invalid_request_error", "param": e.field,
                "code": None}})
        check_chat_shape(tr.body)
        self.seen.append(tr)
        if body.stream:
            sse = "".join(stream_reply(body, self.script))
            return httpx.Response(200, content=sse.encode(),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=plain_reply(body, self.script))


def client_for(server: FakeServer) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.MockTransport(server))
    return openai.OpenAI(base_url="http://akv.test/v1", api_key="x", http_client=http,
                         max_retries=0)


def forced(v: Any) -> Any:
    """A TypedDict validation result with its lazy iterables run (they validate as read)."""
    if isinstance(v, dict):
        return {k: forced(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)) or isinstance(v, Iterator):
        return [forced(x) for x in v]
    return v


def check_chat_shape(chat: dict[str, Any]) -> None:
    """The chat body is a valid OpenAI chat request, and our chat layer's model takes it."""
    forced(CHAT_REQUEST[bool(chat.get("stream"))].validate_python({"model": MODEL, **chat}))
    validated(ChatBody, chat)


def without_parsed(v: Any) -> Any:
    """A client object as a dict, minus the ``parsed*`` fields the stream helper adds."""
    if isinstance(v, dict):
        return {k: without_parsed(x) for k, x in v.items() if not k.startswith("parsed")}
    if isinstance(v, list):
        return [without_parsed(x) for x in v]
    return v


def expected_output(script: Script) -> list[dict[str, Any]]:
    """The output items a script should become (the field values that matter)."""
    out: list[dict[str, Any]] = []
    if script.reasoning:
        out.append({"type": "reasoning", "text": script.reasoning})
    if script.content:
        out.append({"type": "message", "text": script.content})
    out += [{"type": "function_call", "call_id": c, "name": n, "arguments": a}
            for c, n, a in script.calls]
    return out


def summary(resp: Response) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for it in resp.output:
        if it.type == "reasoning":
            assert it.summary == []
            out.append({"type": "reasoning", "text": "".join(c.text for c in it.content)})
        elif it.type == "message":
            assert [c.type for c in it.content] == ["output_text"]
            assert it.content[0].annotations == []
            out.append({"type": "message", "text": it.content[0].text})
        else:
            assert it.type == "function_call" and it.id.startswith("fc_")
            out.append({"type": "function_call", "call_id": it.call_id, "name": it.name,
                        "arguments": it.arguments})
    return out


def check_usage(resp: Response, usage: Usage) -> None:
    u = resp.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (
        usage.input_tokens, usage.output_tokens, usage.input_tokens + usage.output_tokens)
    assert u.input_tokens_details.cached_tokens == usage.cached_tokens
    assert u.output_tokens_details.reasoning_tokens == usage.reasoning_tokens


def check_events(events: list[dict[str, Any]]) -> Response:
    """Every event is a valid stream event, in order, and the deltas add up to the final
    items; returns the final response. An independent reassembly of the stream."""
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    ids: dict[int, str] = {}
    text: dict[int, str] = {}
    done: dict[int, dict[str, Any]] = {}
    for e in events[2:-1]:
        kind, oi = e["type"], e.get("output_index")
        if kind == "response.output_item.added":
            assert oi == len(ids) and e["item"]["status"] == "in_progress"
            ids[oi], text[oi] = e["item"]["id"], ""
            continue
        assert oi in ids and oi not in done
        if "item_id" in e:
            assert e["item_id"] == ids[oi]
        if "content_index" in e:
            assert e["content_index"] == 0
        if kind.endswith(".delta"):
            text[oi] += e["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert e["text"] == text[oi]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == text[oi]
        elif kind == "response.content_part.done":
            assert e["part"]["text"] == text[oi]
        elif kind == "response.output_item.done":
            assert e["item"]["id"] == ids[oi]
            done[oi] = e["item"]
    final = events[-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    assert sorted(done) == list(range(len(ids)))
    assert final["response"]["output"] == [done[i] for i in range(len(done))]
    return Response.model_validate(final["response"])


def parse_sse(chunks: list[str]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        head, data, tail = chunk.split("\n", 2)
        assert head.startswith("event: ") and data.startswith("data: ") and tail == "\n"
        ev = json.loads(data.removeprefix("data: "))
        assert ev["type"] == head.removeprefix("event: ")
        out.append(ev)
    return out


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_client_plain_streamed_and_helper_agree(name):
    script = SCRIPTS[name]
    server = FakeServer(script)
    client = client_for(server)
    request = dict(model=MODEL, input="What's the weather in Paris and Zürich?",
                   instructions="Answer briefly.", tools=[WEATHER, CLOCK],
                   max_output_tokens=200, temperature=0.5, top_p=0.9,
                   reasoning={"effort": "high"}, metadata={"run": "t1"})

    plain = client.responses.create(**request)
    Response.model_validate(plain.to_dict())  # the client only constructs; validate it
    assert summary(plain) == expected_output(script)
    assert plain.output_text == script.content
    check_usage(plain, script.usage)
    assert (plain.id, plain.model, plain.created_at) == (RID, MODEL, CREATED)
    if script.finish == "length":
        assert plain.status == "incomplete"
        assert plain.incomplete_details.reason == "max_output_tokens"
        assert plain.output[-1].status == "incomplete"
        assert {it.status for it in plain.output[:-1]} <= {"completed"}
    else:
        assert plain.status == "completed" and plain.incomplete_details is None
        assert {it.status for it in plain.output} == {"completed"}

    events = [e.to_dict() for e in client.responses.create(**request, stream=True)]
    streamed = check_events(events)
    assert streamed.to_dict() == plain.to_dict()

    if script.finish == "length":
        return  # the stream helper's get_final_response wants response.completed
    text_snap, args_snap = "", {}
    with client.responses.stream(**request) as stream:
        for e in stream:
            # The helper's own snapshots, accumulated from our deltas.
            if e.type == "response.output_text.delta":
                text_snap = e.snapshot
            elif e.type == "response.function_call_arguments.delta":
                args_snap[e.item_id] = e.snapshot
        final = stream.get_final_response()
    assert text_snap == script.content
    assert sorted(args_snap.values()) == sorted(a for _, _, a in script.calls if a)
    assert final.output_text == script.content
    assert without_parsed(final.to_dict()) == plain.to_dict()

    # Every request was translated the same way, streaming aside.
    first = server.seen[0].body
    for tr in server.seen[1:]:
        assert tr.body["stream"] is True and tr.body["stream_options"] == {"include_usage": True}
        assert {k: v for k, v in tr.body.items() if k not in ("stream", "stream_options")} == first
    assert first == {
        "model": MODEL,
        "messages": [{"role": "developer", "content": "Answer briefly."},
                     {"role": "user", "content": "What's the weather in Paris and Zürich?"}],
        "tools": [
            {"type": "function", "function": {k: v for k, v in t.items()
                                              if k != "type" and v is not None}}
            for t in (WEATHER, CLOCK)
        ],
        "max_completion_tokens": 200,
        "temperature": 0.5,
        "top_p": 0.9,
        "reasoning_effort": "high",
    }
    assert server.seen[0].item_to_message == [1]


def test_client_multi_turn_round_trip_with_cache():
    """Turn 2 sends turn 1's output back as items, plus the tool results: the chat messages
    carry the reply exactly as the engine produced it, and cache ops on items map to it."""
    server = FakeServer(CALLING)
    client = client_for(server)
    user = {"role": "user", "content": "Weather in Paris and Zürich?"}
    first = client.responses.create(model=MODEL, input=[user], tools=[WEATHER])
    outputs = [{"type": "function_call_output", "call_id": c, "output": f"{n}: sunny"}
               for c, n, _ in CALLING.calls]
    items = [user, *[it.to_dict() for it in first.output], *outputs,
             {"role": "user", "content": [{"type": "input_text", "text": "And "},
                                          {"type": "input_text", "text": "tomorrow?"}]}]
    # items: 0 user, 1 reasoning, 2 message, 3-4 function_call, 5-6 outputs, 7 user
    assert [it.get("type", "message") for it in items] == [
        "message", "reasoning", "message", "function_call", "function_call",
        "function_call_output", "function_call_output", "message"]
    server.script = Script(content="Sunny again.")
    second = client.responses.create(
        model=MODEL, input=items, tools=[WEATHER], instructions="Be brief.",
        extra_body={"cache": {"drop": {"6": [1, 2, 3, 4, 5, 6]}, "reposition": [6]}},
    )
    assert second.output_text == "Sunny again."
    tr = server.seen[-1]
    assert tr.item_to_message == [1, 2, 2, 2, 2, 3, 4, 5]
    assert tr.body["messages"] == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": user["content"]},
        {"role": "assistant", "content": CALLING.content, "reasoning_content": CALLING.reasoning,
         "tool_calls": [{"id": c, "type": "function", "function": {"name": n, "arguments": a}}
                        for c, n, a in CALLING.calls]},
        {"role": "tool", "tool_call_id": "call_a1", "name": "get_weather",
         "content": "get_weather: sunny"},
        {"role": "tool", "tool_call_id": "call_b2", "name": "get_weather",
         "content": "get_weather: sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert tr.body["cache"] == {"drop": {"4": [2, 3, 4]}, "reposition": [4]}


def test_client_sees_invalid_fields_as_400():
    client = client_for(FakeServer(CALLING))
    cases = [
        (dict(store=True), "store", "store is not supported: this server keeps no state; "
                                    "send store=false"),
        (dict(previous_response_id="resp_1"), "previous_response_id", "keeps no state"),
        (dict(tools=[{"type": "web_search"}]), "tools[0].type", "only function tools"),
        (dict(extra_body={"cache": {"drop": {"0": [3]}}}), 'cache.drop["0"][0]', "out of range"),
    ]
    for kw, field, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, input="hi", **kw)
        assert info.value.body["param"] == field
        assert words in info.value.body["message"]


def test_store_false_and_null_state_fields_are_fine():
    body = validated(ResponsesBody, {"input": "hi", "store": False, "previous_response_id": None,
                                     "background": False, "truncation": "disabled",
                                     "include": ["reasoning.encrypted_content"],
                                     "some_future_field": {"x": 1}})
    assert to_chat(body).body == {"messages": [{"role": "user", "content": "hi"}]}


# --------------------------------------------------------------------------- events


def test_events_interleaved_kinds_and_errors():
    body = validated(ResponsesBody, {"input": "hi", "stream": True})
    ev = ResponseEvents(body, model=MODEL)
    chunks = ev.start()
    chunks += ev.content("") + ev.reasoning("first thought")
    chunks += ev.content("Hello") + ev.content(", you")
    chunks += ev.reasoning("second thought")  # a new reasoning item after the message
    chunks += ev.tool_call(0, "c0", "get_time", "")
    chunks += ev.tool_call(0, None, None, "{}")
    chunks += ev.tool_call(1, "c1", "get_weather", '{"city":')
    chunks += ev.tool_call(1, None, None, ' "Oslo"}')
    chunks += ev.finish("tool_calls", Usage(5, 7))
    final = check_events(parse_sse(chunks))
    assert [(it.type, getattr(it, "status", None)) for it in final.output] == [
        ("reasoning", "completed"), ("message", "completed"), ("reasoning", "completed"),
        ("function_call", "completed"), ("function_call", "completed")]
    assert final.output_text == "Hello, you"
    assert [(it.call_id, it.arguments) for it in final.output[3:]] == [
        ("c0", "{}"), ("c1", '{"city": "Oslo"}')]
    assert len({it.id for it in final.output}) == 5
    assert final.id.startswith("resp_") and ev.response == final.to_dict()

    with pytest.raises(RuntimeError):
        ev.content("late")
    with pytest.raises(ValueError, match="already finished"):
        fresh = ResponseEvents(body)
        fresh.start()
        fresh.tool_call(0, "a", "f", "{")
        fresh.tool_call(1, "b", "f", "{")
        fresh.tool_call(0, None, None, "}")
    with pytest.raises(ValueError, match="id and name"):
        fresh = ResponseEvents(body)
        fresh.start()
        fresh.tool_call(0, None, "f", "{")
    with pytest.raises(ValueError, match="finish reason"):
        fresh = ResponseEvents(body)
        fresh.start()
        fresh.finish("abort", Usage(1, 1))
    with pytest.raises(RuntimeError):
        ResponseEvents(body).content("before start")


def test_error_event_mid_stream_through_the_client():
    body = validated(ResponsesBody, {"input": "hi", "stream": True})
    ev = ResponseEvents(body, model=MODEL)
    chunks = ev.start() + ev.content("partial") + ev.error("generation failed: boom")
    events = parse_sse(chunks)
    for e in events:
        EVENT.validate_python(e)
    assert events[-1] == {"type": "error", "sequence_number": len(events) - 1, "code": None,
                          "message": "generation failed: boom", "param": None}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content="".join(chunks).encode(),
                              headers={"content-type": "text/event-stream"})

    client = openai.OpenAI(base_url="http://akv.test/v1", api_key="x", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    got = list(client.responses.create(model=MODEL, input="hi", stream=True))
    assert got[-1].type == "error" and got[-1].message == "generation failed: boom"


# --------------------------------------------------------------------------- response object


def test_response_object_echoes_the_request():
    body = validated(ResponsesBody, {
        "model": "client-name", "input": "hi", "instructions": "sys", "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False, "max_output_tokens": 9, "temperature": 0.0,
        "top_p": 0.5, "user": "u1", "metadata": {"k": "v"},
        "text": {"format": {"type": "json_schema", "name": "out", "strict": True,
                            "schema": {"type": "object"}}},
    })
    r = response_object(body, content='{"a": 1}', finish_reason="stop", usage=Usage(3, 4),
                        created_at=123)
    resp = Response.model_validate(r)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert (resp.model, resp.created_at, resp.instructions) == ("client-name", 123, "sys")
    assert [t.to_dict() for t in resp.tools] == [WEATHER]
    assert resp.tool_choice.to_dict() == {"type": "function", "name": "get_weather"}
    assert resp.parallel_tool_calls is False
    assert (resp.max_output_tokens, resp.temperature, resp.top_p) == (9, 0.0, 0.5)
    assert resp.text.format.to_dict() == {"type": "json_schema", "name": "out", "strict": True,
                                          "schema": {"type": "object"}}
    assert resp.metadata == {"k": "v"} and resp.user == "u1"
    assert resp.output_text == '{"a": 1}' and resp.output[0].id.startswith("msg_")
    check_usage(resp, Usage(3, 4))

    default = Response.model_validate(response_object(
        validated(ResponsesBody, {"input": "hi"}), finish_reason="stop", usage=Usage(1, 0)))
    assert default.output == [] and default.output_text == ""
    assert (default.tool_choice, default.tools, default.parallel_tool_calls) == ("auto", [], True)
    assert default.text.format.type == "text"


def test_usage_from_chat():
    chat = {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52,
            "prompt_tokens_details": {"cached_tokens": 32}}
    u = Usage.from_chat(chat, reasoning_tokens=5)
    assert u == Usage(40, 12, 32, 5)
    assert u.to_api()["total_tokens"] == chat["total_tokens"]
    assert Usage.from_chat({"prompt_tokens": 1, "completion_tokens": 2}) == Usage(1, 2)


# --------------------------------------------------------------------------- translation


def test_items_to_messages():
    body = validated(ResponsesBody, {
        "model": "m",
        "input": [
            {"role": "system", "content": "You are terse."},                          # 0
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "a"},
                         {"type": "input_text", "text": "b"}]},                        # 1
            {"type": "reasoning", "id": "rs_1", "summary": [
                {"type": "summary_text", "text": "only "},
                {"type": "summary_text", "text": "a summary"}]},                       # 2
            {"type": "function_call", "call_id": "c1", "name": "f",
             "arguments": '{ "x" : 1 }', "id": "fc_1", "status": "completed"},          # 3
            {"type": "function_call_output", "call_id": "c1", "output": "one"},        # 4
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}],
             "content": [{"type": "reasoning_text", "text": "full"}]},                 # 5
            {"role": "assistant", "content": "first"},                                 # 6
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "second", "annotations": []}]},  # 7
            {"role": "developer", "content": "note"},                                  # 8
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},  # 9
            {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "[]"},  # 10
            {"type": "function_call_output", "call_id": "c3",
             "output": [{"type": "input_text", "text": "three"}]},                     # 11
            {"type": "function_call_output", "call_id": "c2", "output": ""},           # 12
            {"role": "user", "content": ""},                                           # 13
        ],
        "tools": [WEATHER, {"type": "function", "name": "g"}],
        "tool_choice": "required",
        "parallel_tool_calls": True,
        "text": {"format": {"type": "json_object"}, "verbosity": "low"},
        "top_k": 20, "seed": 7, "stream": False,
    })
    tr = to_chat(body)
    assert tr.item_to_message == [0, 1, 2, 2, 3, 4, 4, 4, 5, 6, 6, 7, 8, 9]
    assert tr.body == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": None, "reasoning_content": "only a summary",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": '{ "x" : 1 }'}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "one"},
            {"role": "assistant", "content": "first\nsecond", "reasoning_content": "full"},
            {"role": "developer", "content": "note"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}},
                {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "[]"}},
            ]},
            {"role": "tool", "tool_call_id": "c3", "name": "f", "content": "three"},
            {"role": "tool", "tool_call_id": "c2", "name": "g", "content": ""},
            {"role": "user", "content": ""},
        ],
        "tools": [{"type": "function", "function": {
                      "name": "get_weather", "description": "Weather for a city",
                      "parameters": WEATHER["parameters"], "strict": True}},
                  {"type": "function", "function": {"name": "g"}}],
        "tool_choice": "required",
        "parallel_tool_calls": True,
        "response_format": {"type": "json_object"},
        "top_k": 20,
        "seed": 7,
        "stream": False,
    }
    check_chat_shape(tr.body)


def test_formats_and_tool_choice_translate():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = validated(ResponsesBody, {
        "input": "x", "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": schema,
                            "strict": True, "description": "d"}},
    })
    chat = to_chat(body).body
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "out", "schema": schema, "strict": True, "description": "d"}}
    check_chat_shape(chat)
    text = to_chat(validated(ResponsesBody, {"input": "x", "text": {"format": {"type": "text"}},
                                             "tool_choice": "none"})).body
    assert (text["response_format"], text["tool_choice"]) == ({"type": "text"}, "none")


def test_body_json_schema_documents_input():
    schema = ResponsesBody.model_json_schema()
    assert {"input", "cache", "tools", "store"} <= set(schema["properties"])


# --------------------------------------------------------------------------- refusals

LIMITS = Limits(max_new_tokens=64)
FC = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}


@pytest.mark.parametrize("body, field, words", [
    ({"input": "x", "store": True}, "store",
     "store is not supported: this server keeps no state; send store=false"),
    ({"input": "x", "previous_response_id": "resp_9"}, "previous_response_id", "no state"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "no state"),
    ({"input": "x", "background": True}, "background", "no state"),
    ({"input": "x", "tools": [WEATHER, {"type": "file_search"}]}, "tools[1].type",
     'only function tools are supported, got "file_search"'),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name", "required"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name",
     "should match pattern"),
    ({"input": "x", "tools": [WEATHER, CLOCK, WEATHER]}, "tools", "declared twice (tools[2])"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
     "input[0].encrypted_content", "keeps no keys"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "no state"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type", "unsupported input item"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type", "only input_text and output_text"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "Input should be"),
    ({"input": [{**FC, "arguments": {"x": 1}}]}, "input[0].arguments", "valid string"),
    ({"input": [{**FC, "call_id": None}]}, "input[0].call_id", "valid string"),
    ({"input": [FC, {"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input[1].output", "list"),
    ({"input": [{"type": "reasoning", "content": [{"type": "summary_text", "text": "x"}]}]},
     "input[0].content[0].type", "reasoning_text"),
    ({"input": []}, "input", "at least 1"),
    ({"input": 5}, "input", "a string or a list"),
    ({}, "input", "required"),
    ({"input": "x", "tool_choice": "any"}, "tool_choice", "'none', 'auto' or 'required'"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice.type", "function"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type", "json_schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
     "text.format.name", "required"),
    ({"input": "x", "truncation": "auto"}, "truncation", 'only truncation="disabled"'),
    ({"input": "x", "reasoning": {"effort": "minimal"}}, "reasoning.effort", "'low'"),
    ({"input": "x", "max_output_tokens": 65}, "max_output_tokens", "exceeds the limit 64"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
    ({"input": "x", "temperature": True}, "temperature", "valid number"),
    ({"input": "x", "metadata": {"a": 1}}, 'metadata.a', "valid string"),
    ({"input": "x", "stream": "yes"}, "stream", "valid boolean"),
])
def test_invalid_bodies_name_the_field(body, field, words):
    with pytest.raises(InvalidField) as info:
        validated(ResponsesBody, body, LIMITS)
    assert info.value.field == field, info.value
    assert words in info.value.message


@pytest.mark.parametrize("body, field, words", [
    ({"input": [{"type": "function_call_output", "call_id": "zz", "output": "x"}]},
     "input[0].call_id", "no function_call with call_id 'zz'"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name", "no function tool named 'nope'"),
])
def test_translation_refusals_name_the_field(body, field, words):
    with pytest.raises(InvalidField) as info:
        to_chat(validated(ResponsesBody, body))
    assert (info.value.field, words in info.value.message) == (field, True), info.value


# --------------------------------------------------------------------------- cache

# items: 0 user | 1 reasoning, 2 message, 3 call | 4 output | 5 user | 6 call | 7 output
AGENT_ITEMS = [
    {"role": "user", "content": "go"},
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
    {"role": "assistant", "content": "calling"},
    {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "a", "output": "A"},
    {"role": "user", "content": "more"},
    {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "b", "output": "B"},
]


def translate_cache(cache: Any, instructions: str | None = None) -> ChatTranslation:
    body = {"input": AGENT_ITEMS, "cache": cache}
    if instructions is not None:
        body["instructions"] = instructions
    return to_chat(validated(ResponsesBody, body))


@pytest.mark.parametrize("cache, expected", [
    ({"drop": {"4": [1, 2, 3, 4]}, "reposition": [4]}, {"drop": {"2": [1, 2]}, "reposition": [2]}),
    ({"drop": {"7": [3, 2, 1, 7, 6]}}, {"drop": {"5": [1, 4, 5]}}),
    ({"drop": {"3": [0], "7": [4]}, "reposition": [7, 0]},
     {"drop": {"1": [0], "5": [2]}, "reposition": [0, 5]}),
    ({"drop": {"5": []}}, {"drop": {}}),
    ({"reposition": []}, {"reposition": []}),
    ({"drop": {"4": [4]}, "retain_s": 30}, {"drop": {"2": [2]}, "retain_s": 30}),
])
def test_cache_maps_items_to_messages(cache, expected):
    tr = translate_cache(cache)
    assert tr.item_to_message == [0, 1, 1, 1, 2, 3, 4, 5]
    assert tr.body["cache"] == expected
    shifted = translate_cache(cache, instructions="sys")  # the developer message is message 0
    assert shifted.item_to_message == [m + 1 for m in tr.item_to_message]
    assert shifted.body["cache"] == {
        **expected,
        **({"drop": {str(int(b) + 1): [m + 1 for m in ms]
                     for b, ms in expected["drop"].items()}} if "drop" in expected else {}),
        **({"reposition": [b + 1 for b in expected["reposition"]]}
           if "reposition" in expected else {}),
    }


@pytest.mark.parametrize("cache, field, words", [
    ({"drop": {"4": [2, 4]}}, 'cache.drop["4"][0]', "item 1 is not dropped at 4"),
    ({"drop": {"4": [1, 3, 4]}}, 'cache.drop["4"][0]', "item 2 is not dropped at 4"),
    ({"drop": {"3": [1, 2], "4": [3]}}, 'cache.drop["3"][0]', "item 3 is not dropped at 3"),
    ({"drop": {"2": [1, 2]}}, 'cache.drop["2"]', "last item of its message, here input item 3"),
    ({"drop": {"1": [0]}}, 'cache.drop["1"]', "input item 3"),
    ({"reposition": [0, 2]}, "cache.reposition[1]", "boundary 2 is inside message 1"),
    ({"drop": {"8": [0]}}, 'cache.drop["8"]', "out of range [0, 8)"),
    ({"drop": {"7": [8]}}, 'cache.drop["7"][0]', "out of range [0, 8)"),
    ({"reposition": [-1]}, "cache.reposition[0]", "out of range"),
    ({"drop": {"4": [5]}}, 'cache.drop["4"][0]', "before it exists"),
    ({"drop": {"4": [0], "5": [0]}}, 'cache.drop["5"][0]', "dropped twice"),
    ({"drop": {"x": [0]}}, 'cache.drop["x"]', "expected an integer"),
    ({"drop": [0]}, "cache.drop", "expected an object"),
    ([1], "cache", "expected an object"),
])
def test_invalid_cache_names_the_field(cache, field, words):
    with pytest.raises(InvalidField) as info:
        translate_cache(cache)
    assert info.value.field == field, info.value
    assert words in info.value.message, info.value


def random_items(rng: random.Random) -> list[dict[str, Any]]:
    """A random agent-like conversation as input items."""
    items, calls = [], 0
    for _ in range(rng.randint(1, 8)):
        kind = rng.choice(["user", "system", "assistant", "assistant", "tool"])
        if kind == "tool" and calls:
            items.append({"type": "function_call_output", "call_id": f"c{calls - 1}",
                          "output": "o"})
        elif kind == "assistant":
            for _ in range(rng.randint(1, 3)):
                sub = rng.choice(["reasoning", "message", "call"])
                if sub == "reasoning":
                    items.append({"type": "reasoning", "summary": [{"type": "summary_text",
                                                                    "text": "s"}]})
                elif sub == "message":
                    items.append({"role": "assistant", "content": "a"})
                else:
                    items.append({"type": "function_call", "call_id": f"c{calls}", "name": "f",
                                  "arguments": "{}"})
                    calls += 1
        else:
            items.append({"role": "user" if kind == "user" else "system", "content": "u"})
    return items


def test_cache_translation_matches_message_level_ops_random():
    """Ops chosen on messages, written on items (a boundary is its message's last item, a
    dropped message all of its items), translate back to exactly those ops."""
    rng = random.Random(0)
    for _ in range(300):
        items = random_items(rng)
        tr = to_chat(validated(ResponsesBody, {"input": items}))
        n = len(tr.body["messages"])
        members = [[i for i, m in enumerate(tr.item_to_message) if m == k] for k in range(n)]
        assert sorted(sum(members, [])) == list(range(len(items)))  # every item in one message
        assert all(ms and ms == list(range(ms[0], ms[-1] + 1)) for ms in members)
        live = list(range(n))
        drops: dict[int, list[int]] = {}
        for b in range(n):
            here = [m for m in live if m <= b and rng.random() < 0.3]
            if here:
                drops[b] = here
                live = [m for m in live if m not in here]
        repos = sorted(rng.sample(range(n), rng.randint(0, n)))
        cache = {"drop": {str(members[b][-1]): sorted(i for m in ms for i in members[m])
                          for b, ms in drops.items()},
                 "reposition": [members[b][-1] for b in repos]}
        got = to_chat(validated(ResponsesBody, {"input": items, "cache": cache})).body["cache"]
        assert got == {"drop": {str(b): ms for b, ms in drops.items()}, "reposition": repos}
