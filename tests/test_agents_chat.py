"""Agents drive the server: tool calls, structured output and the next turn's cache hit, from
the official ``openai`` client, on every tiny model family the paper's agents run on.

The models are random, so the replies' prose means nothing; what is checked is what a client
relies on: with ``tool_choice`` required or named every reply is a call whose arguments
validate (``jsonschema``, the reference validator) against the tool's schema; a
``json_schema`` reply validates against its schema; a streamed reply assembles to the same
message as the whole one; and the turn after a call, its arguments sent back verbatim, finds
the previous prompt and the reply in the cache.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_support import AGENT_MODELS, agent_server_args, shared_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 10},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                            "maxItems": 2}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather by city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "lookup", "description": "Search notes.",
                                      "parameters": LOOKUP}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 16},
                   # An integer: a number's digits are unbounded ("1.0000...") and a random
                   # model may never stop writing them.
                   "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
MESSAGES = [
    {"role": "system", "content": "You are a weather agent."},
    {"role": "user", "content": "What is the weather in Paris for 3 days?"},
]


@pytest.fixture(scope="module", params=AGENT_MODELS)
def model(request):
    return request.param


@pytest.fixture(scope="module")
def client(model):
    srv = shared_server(agent_server_args(model))
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c


def chat(client: openai.OpenAI, model: str, messages=MESSAGES, **kw):
    kw.setdefault("max_tokens", 256)  # byte vocabularies spend 4 tokens a character
    return client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def check_calls(message, names: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_choice_gives_a_valid_call(client, model):
    resp = chat(client, model, tools=TOOLS, tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message, set(SCHEMAS))
    assert choice.message.content in (None, "")  # the call is not content


def test_named_tool_streams_as_the_whole_reply(client, model):
    named = {"type": "function", "function": {"name": "lookup"}}
    whole = chat(client, model, tools=TOOLS, tool_choice=named).choices[0]
    check_calls(whole.message, {"lookup"})
    calls: dict[int, dict] = {}
    reasoning, finish = "", None
    for chunk in chat(client, model, tools=TOOLS, tool_choice=named, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or ():
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert c["id"] is None, "a call's id comes once"
                c["id"] = tc.id
            if tc.function and tc.function.name:
                assert c["name"] is None, "a call's name comes once"
                c["name"] = tc.function.name
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert reasoning == (getattr(whole.message, "reasoning_content", None) or "")


def test_json_schema_reply_validates(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER,
                                                  "strict": True}}
    resp = chat(client, model, response_format=fmt)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(msg.content), ANSWER)
    obj = chat(client, model, response_format={"type": "json_object"}).choices[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    else:  # a random model may write one endless string: nothing in json_object bounds it
        assert obj.finish_reason == "length" and obj.message.content.startswith("{")


def test_next_turn_hits_the_reply_in_the_cache(client, model):
    first = chat(client, model, tools=TOOLS, tool_choice="required", logprobs=True)
    msg = first.choices[0].message
    check_calls(msg, set(SCHEMAS))
    resent = {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in msg.tool_calls]}
    reasoning = getattr(msg, "reasoning_content", None)
    if reasoning:
        resent["reasoning_content"] = reasoning
    results = [{"role": "tool", "tool_call_id": c.id, "content": '{"temp": 21}'}
               for c in msg.tool_calls]
    second = chat(client, model, messages=[*MESSAGES, resent, *results], tools=TOOLS,
                  max_tokens=4)
    # Everything the first turn fed the model: its prompt and its reply up to the last token
    # it sampled (that one, and the tokens the grammar forced after it, were never fed, so
    # have no KV). Forced tokens come without a log-probability.
    lps = [t.logprob for t in first.choices[0].logprobs.content]
    last_sampled = max(i for i, lp in enumerate(lps) if lp is not None)
    fed = first.usage.prompt_tokens + last_sampled
    assert second.usage.prompt_tokens_details.cached_tokens >= fed


def test_auto_tool_choice_never_fails(client, model):
    """A random model under ``auto`` writes what it writes: a reply, never a 500."""
    resp = chat(client, model, tools=TOOLS, max_tokens=24)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert resp.choices[0].message.role == "assistant"


def test_bad_agent_requests_are_400(client, model):
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name"),
        (dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}}),
         "response_format.json_schema.schema"),
        (dict(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"minimum": "x"}}}
        }}], tool_choice="required"), "tools[0].function.parameters"),
    ]
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, model, **kw)
        assert info.value.body["param"] == field, info.value.body
    assert chat(client, model, max_tokens=2).choices[0].message.role == "assistant"


def test_developer_message_reaches_the_prompt(client, model):
    """OpenAI's instructions role: rendered by a template that has it (harmony's), and as a
    system message by one that has not (Qwen3's and MiniMax-M2's drop it otherwise)."""
    user = MESSAGES[1:]
    note = {"role": "developer", "content": "Use metric units."}

    def prompt_tokens(messages) -> int:
        return chat(client, model, messages=messages, max_tokens=1).usage.prompt_tokens

    with_note = prompt_tokens([note, *user])
    assert with_note != prompt_tokens(user)  # (MiniMax-M2's default system text is longer)
    if model not in ("tiny-gpt-oss", "tiny-gpt-oss-bpe"):
        assert with_note == prompt_tokens([{**note, "role": "system"}, *user])
