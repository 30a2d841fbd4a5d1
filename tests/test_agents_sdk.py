"""A real agent framework drives the server: the OpenAI Agents SDK (``openai-agents``) over
both of our APIs, and the official ``openai`` client's Responses calls, on every tiny model
family: GPT-OSS (harmony; byte and o200k vocabularies), Qwen3-MoE (hermes calls; byte and
Qwen3 vocabularies) and MiniMax-M2 (XML calls).

The SDK is what agent code runs: its ``OpenAIChatCompletionsModel`` speaks
``/v1/chat/completions`` and its ``OpenAIResponsesModel`` ``/v1/responses``, each with its own
request shape (instructions as a system message or as ``instructions``, tools nested or flat,
output types as ``response_format`` or ``text.format``, the turn after a call as messages or
as items with reasoning). Checked, for both, with tracing off and no network: ``Runner.run``
and ``Runner.run_streamed`` invoke the Python tool with arguments valid against the tool's
JSON schema (``jsonschema``, the reference validator); a named ``tool_choice`` holds over two
turns, the second sending the first call and its output back and finding the first prompt in
the cache; an ``output_type`` comes back as the pydantic model. Both APIs render the same
prompt, so at temperature 0 they must give the same call and the same structured output: a
route that dropped or changed part of the request shows up as a different reply.

Then the Responses API from the official client, as a client that is not the SDK uses it: a
required tool call and a ``json_schema`` format validate; streamed events (raw, and through
the client's ``responses.stream`` helper) assemble to the non-streamed response; and a second
turn that sends the call and its output back as input items hits the cache.

The models are random weights, so replies are checked for structure and validity, never
prose: schemas bound every string (``maxLength``) and number (integers with a minimum and a
maximum), so a random model's reply ends within ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import agents
import httpx
import jsonschema
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    ToolsToFinalOutputResult,
    function_tool,
)
from pydantic import BaseModel, Field
from server_support import AGENT_MODELS, agent_server_args, shared_server

APIS = ("chat", "responses")
INSTRUCTIONS = "You are a weather agent."
QUESTION = "What is the weather in Paris for 3 days?"
MAX_TOKENS = 256  # byte vocabularies spend 4 tokens a character
# The chat model of the SDK does not send reasoning_content back: the reasoning the template
# then leaves out is served as a drop (docs/agents.md), so the reply stays a cache hit.
DROP_REMOVED_REASONING = {"cache": {"removed_reasoning": "drop"}}

agents.set_tracing_disabled(True)


@pytest.fixture(scope="module", params=AGENT_MODELS)
def model(request):
    return request.param


@pytest.fixture(scope="module")
def url(model):
    return shared_server(agent_server_args(model)).url + "/v1"


# --------------------------------------------------------------------------- the Agents SDK


class Answer(BaseModel):
    answer: str = Field(max_length=16)
    # An integer: a number's digits are unbounded and a random model may never stop writing.
    confidence: int = Field(ge=0, le=100)


# Answer's schema closed, as a strict format's must be (the SDK closes its own copy so): an
# open one lets a random model write extra keys forever.
ANSWER = {**Answer.model_json_schema(), "additionalProperties": False}


class Tools:
    """The agent's two function tools; every invocation is logged as (name, arguments)."""

    def __init__(self):
        self.calls: list[tuple[str, dict[str, Any]]] = []

        @function_tool
        def get_weather(city: Annotated[str, Field(max_length=12)],
                        days: Annotated[int, Field(ge=1, le=7)]) -> str:
            """Weather by city.

            Args:
                city: The city.
                days: How many days ahead.
            """
            self.calls.append(("get_weather", {"city": city, "days": days}))
            return "sunny"

        @function_tool
        def lookup(query: Annotated[str, Field(max_length=10)]) -> str:
            """Search notes.

            Args:
                query: What to look for.
            """
            self.calls.append(("lookup", {"query": query}))
            return "no notes"

        self.tools = [get_weather, lookup]
        self.schemas = {t.name: t.params_json_schema for t in self.tools}
        self.outputs = {"get_weather": "sunny", "lookup": "no notes"}

    def check(self, calls: list[tuple[str, dict[str, Any]]], names: set[str]) -> None:
        assert calls, "the tool was never invoked"
        for name, args in calls:
            assert name in names, calls
            jsonschema.validate(args, self.schemas[name])


class Sdk:
    """An ``AsyncOpenAI`` client for the SDK's models, logging each request body it sends;
    used through :func:`with_sdk`."""

    def __init__(self, url: str, model: str):
        self.bodies: list[dict[str, Any]] = []

        async def log(request: httpx.Request) -> None:
            self.bodies.append(json.loads(request.content))

        self.client = openai.AsyncOpenAI(
            base_url=url, api_key="unused", max_retries=0,
            http_client=httpx.AsyncClient(timeout=300, event_hooks={"request": [log]}))
        self.model_name = model

    def model(self, api: str):
        cls = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
        return cls(model=self.model_name, openai_client=self.client)


async def with_sdk(sdk: Sdk, go: Callable[[Sdk], Awaitable[Any]]) -> Any:
    """``go(sdk)``, then close the client in the event loop its connections belong to."""
    try:
        return await go(sdk)
    finally:
        await sdk.client.close()


def settings(**kw) -> ModelSettings:
    return ModelSettings(temperature=0, max_tokens=MAX_TOKENS, **kw)


def raw_calls(result) -> list[tuple[str, dict[str, Any]]]:
    """The calls of a run's tool-call items, as the model wrote them."""
    return [(it.raw_item.name, json.loads(it.raw_item.arguments))
            for it in result.new_items if it.type == "tool_call_item"]


def test_agent_invokes_the_tool(url, model):
    """``tool_choice`` required, one call per reply, stop on the first tool: each of run and
    run_streamed, over each API, invokes the tool once with valid arguments (those the model
    wrote), and all four runs agree (one prompt, temperature 0)."""
    tools, got = Tools(), {}

    async def go(sdk: Sdk) -> None:
        for api in APIS:
            agent = Agent(name="weather", instructions=INSTRUCTIONS, model=sdk.model(api),
                          tools=tools.tools, tool_use_behavior="stop_on_first_tool",
                          model_settings=settings(tool_choice="required",
                                                  parallel_tool_calls=False))
            tools.calls.clear()
            result = await Runner.run(agent, QUESTION, max_turns=2)
            assert len(tools.calls) == 1 and raw_calls(result) == tools.calls
            assert result.final_output == tools.outputs[tools.calls[0][0]]
            got[api, "run"] = tools.calls[:]

            tools.calls.clear()
            streamed = Runner.run_streamed(agent, QUESTION, max_turns=2)
            items = [ev.item.type async for ev in streamed.stream_events()
                     if ev.type == "run_item_stream_event"]
            assert items == [it.type for it in streamed.new_items]
            # The harmony model reasons first: the SDK makes that a reasoning item.
            assert [t for t in items if t != "reasoning_item"] == ["tool_call_item",
                                                                  "tool_call_output_item"]
            assert len(tools.calls) == 1 and raw_calls(streamed) == tools.calls
            assert streamed.final_output == tools.outputs[tools.calls[0][0]]
            got[api, "streamed"] = tools.calls[:]

    sdk = Sdk(url, model)
    asyncio.run(with_sdk(sdk, go))
    # The SDK spoke each API as it does to OpenAI.
    assert [("messages" in b, "input" in b) for b in sdk.bodies] == [
        (True, False), (True, False), (False, True), (False, True)]
    assert {b["tool_choice"] for b in sdk.bodies} == {"required"}
    assert sdk.bodies[2]["instructions"] == INSTRUCTIONS
    tools.check(got["chat", "run"], {"get_weather", "lookup"})
    assert len(set(map(repr, got.values()))) == 1, got


def test_named_tool_over_two_turns_hits_the_cache(url, model):
    """``tool_choice`` naming ``lookup``, kept for the second turn: the second request sends
    the first call and its output back (as messages without the reasoning, or as items
    with the reasoning item) and finds the whole first prompt and part of the reply in the
    cache: the reasoning the chat messages leave out is served as a drop."""
    for api in APIS:
        tools = Tools()

        def stop_after_two(ctx, results, tools=tools) -> ToolsToFinalOutputResult:
            return ToolsToFinalOutputResult(is_final_output=len(tools.calls) >= 2,
                                            final_output=results[-1].output)

        async def go(sdk: Sdk, api=api, stop=stop_after_two, tools=tools):
            agent = Agent(name="notes", instructions=INSTRUCTIONS, model=sdk.model(api),
                          tools=tools.tools, tool_use_behavior=stop, reset_tool_choice=False,
                          model_settings=settings(tool_choice="lookup",
                                                  parallel_tool_calls=False,
                                                  extra_body=DROP_REMOVED_REASONING))
            return await Runner.run(agent, QUESTION, max_turns=3)

        sdk = Sdk(url, model)
        result = asyncio.run(with_sdk(sdk, go))
        assert [name for name, _ in tools.calls] == ["lookup", "lookup"]
        tools.check(tools.calls, {"lookup"})
        assert raw_calls(result) == tools.calls
        assert result.final_output == "no notes"
        assert len(sdk.bodies) == 2 and len(result.raw_responses) == 2
        if api == "responses":
            second = sdk.bodies[1]["input"]
            assert second[0] == {"role": "user", "content": QUESTION}
            kinds = [it["type"] for it in second[1:]]
            assert kinds[-2:] == ["function_call", "function_call_output"], kinds
            assert set(kinds[:-2]) <= {"reasoning"}, kinds  # reasoning, where the model wrote some
            assert second[-1]["output"] == "no notes"
        first, again = (r.usage for r in result.raw_responses)
        assert again.input_tokens > first.input_tokens
        # The first prompt and (some of) its reply: the reply was fed but for its last
        # tokens, and, with its reasoning left out of the resent history, served as a drop.
        assert again.input_tokens_details.cached_tokens > first.input_tokens, (api, first,
                                                                                 again)


def test_output_type_is_the_pydantic_model(url, model):
    """An ``output_type`` goes out as a strict ``json_schema`` format (``response_format``
    for chat, ``text.format`` for responses) and comes back as the model; both APIs agree."""
    out = {}

    async def go(sdk: Sdk) -> None:
        for api in APIS:
            agent = Agent(name="answer", instructions="Answer with confidence.",
                          model=sdk.model(api), output_type=Answer, model_settings=settings())
            result = await Runner.run(agent, "Will it rain tomorrow?", max_turns=1)
            assert isinstance(result.final_output, Answer), result.final_output
            out[api] = result.final_output

    sdk = Sdk(url, model)
    asyncio.run(with_sdk(sdk, go))
    chat, responses = sdk.bodies
    fmt = chat["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert responses["text"]["format"] == {"type": "json_schema", **fmt["json_schema"]}
    jsonschema.validate(out["chat"].model_dump(), ANSWER)
    assert out["chat"] == out["responses"]


# --------------------------------------------------------------------------- Responses, raw

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 10}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather by city.",
     "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "lookup", "description": "Search notes.",
     "parameters": LOOKUP, "strict": True},
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
INPUT = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def create(client: openai.OpenAI, model: str, **kw):
    kw.setdefault("max_output_tokens", MAX_TOKENS)
    kw.setdefault("input", INPUT)
    return client.responses.create(model=model, instructions=INSTRUCTIONS, temperature=0, **kw)


def comparable(output: list[Any]) -> list[dict[str, Any]]:
    """Output items without what differs between two responses to one request (item ids and
    call ids are fresh each time) or what the stream helper adds (``parsed_arguments``, a
    part's ``parsed``)."""
    out = []
    for it in output:
        d = it if isinstance(it, dict) else it.to_dict()
        d = {k: v for k, v in d.items() if k not in ("id", "call_id", "parsed_arguments")}
        if "content" in d:
            d["content"] = [{k: v for k, v in p.items() if k != "parsed"} for p in d["content"]]
        out.append(d)
    return out


def assemble(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The Response a raw event stream describes, built from its deltas alone; checks the
    stream's own consistency on the way (numbering, one open item, each item's done form)."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    items: list[dict[str, Any]] = []
    text: list[str] = []
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(items)
            items.append(e["item"])
            text.append("")
        elif kind.endswith(".delta"):
            assert e["output_index"] == len(items) - 1, "a delta to an item not open"
            text[-1] += e["delta"]
        elif kind == "response.output_item.done":
            assert e["output_index"] == len(items) - 1
            item = dict(items[-1], status=e["item"]["status"])
            if item["type"] == "function_call":
                item["arguments"] = text[-1]
            else:
                part = "reasoning_text" if item["type"] == "reasoning" else "output_text"
                assert len(e["item"]["content"]) == 1
                item["content"] = [{**e["item"]["content"][0], "type": part, "text": text[-1]}]
            assert item == e["item"], (item, e["item"])
            items[-1] = item
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete")
    assert last["response"]["output"] == items
    return last["response"]


def check_usage(usage) -> None:
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert 0 <= usage.output_tokens_details.reasoning_tokens <= usage.output_tokens


def test_responses_required_call_streams_as_the_whole(client, model):
    whole = create(client, model, tools=TOOLS, tool_choice="required",
                   parallel_tool_calls=False)
    assert whole.status == "completed" and whole.error is None
    calls = [it for it in whole.output if it.type == "function_call"]
    assert len(calls) == 1 and calls[0].status == "completed" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    assert {it.type for it in whole.output} <= {"reasoning", "function_call"}
    assert whole.output_text == ""  # a call is not text
    check_usage(whole.usage)

    with create(client, model, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                stream=True) as stream:
        events = [e.to_dict() for e in stream]
    streamed = assemble(events)
    assert streamed["status"] == "completed"
    assert comparable(streamed["output"]) == comparable(whole.output)
    assert streamed["usage"]["output_tokens"] == whole.usage.output_tokens


def test_responses_json_schema_streams_as_the_whole(client, model):
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER,
                      "strict": True}}
    whole = create(client, model, text=fmt)
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), ANSWER)
    assert [it.type for it in whole.output][-1] == "message"
    check_usage(whole.usage)

    deltas = ""
    with client.responses.stream(model=model, instructions=INSTRUCTIONS, input=INPUT,
                                 temperature=0, max_output_tokens=MAX_TOKENS,
                                 text=fmt) as stream:
        for e in stream:
            if e.type == "response.output_text.delta":
                deltas += e.delta
        final = stream.get_final_response()
    assert deltas == final.output_text == whole.output_text
    assert comparable(final.output) == comparable(whole.output)


def test_responses_second_turn_hits_the_cache(client, model):
    """The first reply's items (reasoning included) and the call's output sent back as
    input: the second turn is answered, and its prompt's cached part covers the first prompt
    and part of the reply (tokens the model was fed while writing it)."""
    first = create(client, model, tools=TOOLS, tool_choice={"type": "function", "name": "lookup"})
    calls = [it for it in first.output if it.type == "function_call"]
    assert calls and all(c.name == "lookup" for c in calls)
    items = [*INPUT, *(it.to_dict() for it in first.output),
             *({"type": "function_call_output", "call_id": c.call_id, "output": "no notes"}
               for c in calls)]
    second = create(client, model, input=items, tools=TOOLS, max_output_tokens=8)
    assert second.status in ("completed", "incomplete")
    check_usage(second.usage)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens, (
        first.usage, second.usage)


def test_instructions_and_developer_messages_reach_the_prompt(client, model):
    """``instructions`` is a developer message first, and a developer message takes the
    template's instructions role: the developer role where the template has one (harmony),
    else the system role (Qwen3's and MiniMax-M2's templates drop a developer message, or
    refuse a prompt made of one)."""

    def prompt_tokens(messages: list[dict[str, str]], **kw) -> int:
        resp = client.responses.create(model=model, input=messages, tools=TOOLS, temperature=0,
                                       max_output_tokens=1, **kw)
        return resp.usage.input_tokens

    as_instructions = prompt_tokens(INPUT, instructions=INSTRUCTIONS)
    as_developer = prompt_tokens([{"role": "developer", "content": INSTRUCTIONS}, *INPUT])
    assert as_instructions == as_developer != prompt_tokens(INPUT)
    if not model.startswith("tiny-gpt-oss"):
        assert as_developer == prompt_tokens([{"role": "system", "content": INSTRUCTIONS},
                                              *INPUT])
