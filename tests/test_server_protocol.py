"""Request parsing (no server): every rejection names its field and index."""

from __future__ import annotations

import json

import pytest

from akv_jax.cache.ops import CacheOpError, OpHistory
from akv_jax.cache.timeline import timeline
from akv_jax.errors import InvalidField
from akv_jax.serving import protocol
from akv_jax.serving.body_validation import field_path
from akv_jax.serving.chat_body import ChatBody
from akv_jax.serving.generate_body import GenerateBody
from akv_jax.serving.protocol import Limits
from akv_jax.serving.types import SamplingParams

LIMITS = Limits(max_segments=8, max_prompt_tokens=100, max_new_tokens=64, max_stop=2,
                max_body_bytes=10_000)
VOCAB = 512


def gen(body: dict) -> protocol.GenerateInput:
    return protocol.parse_generate(body, LIMITS, VOCAB)


def rejected(fn, body: dict) -> InvalidField:
    with pytest.raises(InvalidField) as info:
        fn(body, LIMITS, VOCAB)
    return info.value


def test_generate_defaults_and_flat_list():
    inp = gen({"input_ids": [1, 2, 3]})
    assert [s.tolist() for s in inp.segments] == [[1, 2, 3]]
    assert inp.history == OpHistory.empty(1)
    assert inp.sampling == SamplingParams(max_new_tokens=16)
    assert (inp.return_logprob, inp.stream) == (False, False)


def test_generate_full_request():
    inp = gen({
        "input_ids": [[1, 2], [3], [4, 5]],
        "cache": {"drop": {"2": [1]}, "reposition": [2]},
        "sampling_params": {"max_new_tokens": 8.0, "temperature": 0.7, "top_p": 0.9,
                            "top_k": -1, "seed": 7, "stop_token_ids": [5, 6],
                            "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    })
    assert [s.tolist() for s in inp.segments] == [[1, 2], [3], [4, 5]]
    assert inp.history == OpHistory(3, {2: (1,)}, (2,))
    assert inp.sampling == SamplingParams(8, 0.7, 0.9, 0, 7, (5, 6), True)
    assert (inp.return_logprob, inp.stream) == (True, True)


@pytest.mark.parametrize(
    "body, field, words",
    [
        ({}, "input_ids", "required"),
        ({"input_ids": "abc"}, "input_ids", "non-empty list"),
        ({"input_ids": []}, "input_ids", "non-empty list"),
        ({"input_ids": [[1], []]}, "input_ids[1]", "empty segment"),
        ({"input_ids": [[1], [2, "x"]]}, "input_ids[1][1]", "integer token id"),
        ({"input_ids": [[1], [2, 1.5]]}, "input_ids[1][1]", "integer token id"),
        ({"input_ids": [[1], [512]]}, "input_ids[1][0]", "token id 512 outside the vocabulary"),
        ({"input_ids": [[-1]]}, "input_ids[0][0]", "token id -1 outside the vocabulary"),
        ({"input_ids": [[1]] * 9}, "input_ids", "9 segments exceed the limit of 8"),
        ({"input_ids": [[1] * 60, [2] * 41]}, "input_ids", "101 prompt tokens exceed"),
        ({"input_ids": [1] * 101}, "input_ids", "101 prompt tokens exceed"),
        ({"input_ids": [[1], [2]], "cache": [1]}, "cache", "expected an object"),
        ({"input_ids": [[1], [2]], "cache": {"evict": {}}}, "cache.evict", "unknown"),
        ({"input_ids": [[1], [2]], "cache": {"drop": {"7": [0]}}}, 'cache.drop["7"]',
         "boundary 7 out of range [0, 2)"),
        ({"input_ids": [[1], [2]], "cache": {"drop": {"a": [0]}}}, 'cache.drop["a"]',
         "expected an integer"),
        ({"input_ids": [[1], [2]], "cache": {"drop": {"0": [1]}}}, 'cache.drop["0"][0]',
         "segment 1 is dropped at boundary 0 before it exists"),
        ({"input_ids": [[1], [2], [3]], "cache": {"drop": {"1": [0], "2": [0]}}},
         'cache.drop["2"][0]', "dropped twice"),
        ({"input_ids": [[1], [2]], "cache": {"drop": {"1": [0.5]}}}, 'cache.drop["1"][0]',
         "expected an integer"),
        ({"input_ids": [[1], [2]], "cache": {"reposition": [1, 1]}}, "cache.reposition[1]",
         "duplicate reposition boundary 1"),
        ({"input_ids": [[1], [2]], "cache": {"reposition": [2]}}, "cache.reposition[0]",
         "boundary 2 out of range [0, 2)"),
        ({"input_ids": [[1], [2]], "cache": {"reposition": 1}}, "cache.reposition",
         "expected a list"),
        ({"input_ids": [1], "sampling_params": [1]}, "sampling_params",
         "should be an object, got [1]"),
        ({"input_ids": [1], "sampling_params": {"max_tokens": 3}},
         "sampling_params.max_tokens", "unknown field"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 65}},
         "sampling_params.max_new_tokens", "65 exceeds the limit 64"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}},
         "sampling_params.max_new_tokens", "greater than or equal to 1, got 0"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": True}},
         "sampling_params.max_new_tokens", "valid integer, got true"),
        ({"input_ids": [1], "sampling_params": {"temperature": "hot"}},
         "sampling_params.temperature", "valid number, got 'hot'"),
        ({"input_ids": [1], "sampling_params": {"temperature": -0.1}},
         "sampling_params.temperature", "-0.1 is not a finite number >= 0"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p",
         "0.0 is outside (0, 1]"),
        ({"input_ids": [1], "sampling_params": {"top_k": -2}}, "sampling_params.top_k",
         "greater than or equal to -1, got -2"),
        ({"input_ids": [1], "sampling_params": {"seed": 2**64}}, "sampling_params.seed",
         "less than or equal to 9223372036854775807"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [3, 600]}},
         "sampling_params.stop_token_ids[1]", "token id 600 outside the vocabulary"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [1, 2, 3]}},
         "sampling_params.stop_token_ids", "3 entries exceed the limit of 2"),
        ({"input_ids": [1], "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos",
         "valid boolean, got 1"),
        ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob", "valid boolean, got 'yes'"),
        ({"input_ids": [1], "stream": None, "text": "hi"}, "text", "unknown field"),
    ],
)
def test_generate_rejections(body, field, words):
    err = rejected(protocol.parse_generate, body)
    assert err.field == field
    assert words in err.message
    assert str(err).startswith(f"{field}: ")
    # Op-history and segment errors are CacheOpError; sampling, limits and the body's shape
    # are invalid requests of other kinds.
    if field.startswith("cache"):
        assert isinstance(err, CacheOpError)
    elif not field.startswith("input_ids"):
        assert not isinstance(err, CacheOpError)


def test_json_body():
    assert protocol.parse_json_body(b'{"a": 1}', LIMITS) == {"a": 1}
    for raw, words in [
        (b'{"a": ', "malformed JSON"),
        (b"\xff\xfe", "malformed JSON"),
        (b'{"a": NaN}', "NaN is not valid JSON"),
        (b"[1, 2]", "expected a JSON object, got a list"),
        (b'"x"', "expected a JSON object, got a string"),
        (b" " * 10_001, "exceeds the limit of 10000 bytes"),
    ]:
        with pytest.raises(InvalidField) as info:
            protocol.parse_json_body(raw, LIMITS)
        assert info.value.field == "body"
        assert words in info.value.message
        assert not isinstance(info.value, CacheOpError)
        assert isinstance(info.value, protocol.BodyTooLarge) == (len(raw) > 10_000)


def chat_body(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def test_chat_parse():
    inp = protocol.parse_chat(
        chat_body(
            messages=[
                {"role": "system", "content": [{"type": "text", "text": "be "},
                                               {"type": "text", "text": "brief"}]},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function",
                     "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            ],
            max_tokens=5, max_completion_tokens=7, temperature=0, seed=3, stop="END",
            stream=True, stream_options={"include_usage": True}, logprobs=True,
            cache={"drop": {"1": [0]}}, n=1, presence_penalty=0,
            tools=[{"type": "function", "function": {"name": "f"}}],
            user="ignored-openai-field",
        ),
        LIMITS, VOCAB,
    )
    assert inp.messages[0]["content"] == "be brief"
    assert inp.messages[2]["content"] == ""
    assert inp.max_tokens == 7  # max_completion_tokens wins
    assert inp.sampling.seed == 3 and inp.sampling.temperature == 0.0
    assert inp.stop == ("END",)
    assert (inp.stream, inp.include_usage, inp.logprobs) == (True, True, True)
    assert inp.cache == {"drop": {"1": [0]}}
    assert inp.template_kwargs == {"tools": [{"type": "function", "function": {"name": "f"}}]}
    assert (inp.tool_choice, inp.parallel_tool_calls) == ("auto", True)
    assert protocol.chat_history(inp.cache, 3, 4) == OpHistory(4, {1: (0,)}, ())


@pytest.mark.parametrize(
    "body, field, words",
    [
        ({"model": "m"}, "messages", "required"),
        (chat_body(messages=[]), "messages", "at least 1 required, got 0"),
        (chat_body(messages=[{"role": "user", "content": "x"}] * 9), "messages",
         "9 messages exceed the limit of 8"),
        (chat_body(messages=["hi"]), "messages[0]", "should be an object, got 'hi'"),
        (chat_body(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "robot"),
        (chat_body(messages=[{"role": "user", "content": 3}]), "messages[0].content",
         "expected a string or a list of content parts, got 3"),
        (chat_body(messages=[{"role": "user"}]), "messages[0].content", "required"),
        (chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         "messages[0].content[0]", "only {'type': 'text'}"),
        (chat_body(model=3), "model", "valid string, got 3"),
        (chat_body(n=2), "n", "only n=1"),
        (chat_body(max_tokens=0), "max_tokens", "greater than or equal to 1, got 0"),
        (chat_body(max_tokens=65), "max_tokens", "exceeds the limit 64"),
        (chat_body(max_completion_tokens="5"), "max_completion_tokens",
         "valid integer, got '5'"),
        (chat_body(stop=["a", ""]), "stop[1]", "at least 1 character, got ''"),
        (chat_body(stop=["a", "b", "c"]), "stop", "3 entries exceed the limit of 2"),
        (chat_body(stop=5), "stop", "valid list, got 5"),
        (chat_body(stream="yes"), "stream", "valid boolean, got 'yes'"),
        (chat_body(stream_options={"include_usage": 1}), "stream_options.include_usage",
         "valid boolean, got 1"),
        (chat_body(temperature=101), "temperature", "less than or equal to 100, got 101"),
        (chat_body(temperature=-1), "temperature", "-1.0 is not a finite number >= 0"),
        (chat_body(top_logprobs=3), "top_logprobs", "only top_logprobs=0"),
        (chat_body(presence_penalty=0.5), "presence_penalty", "not supported"),
        (chat_body(logit_bias={"1": 5}), "logit_bias", "not supported"),
        (chat_body(response_format={"type": "xml"}), "response_format.type",
         "'text', 'json_object' or 'json_schema'"),
        (chat_body(response_format={"type": "json_schema"}), "response_format",
         "json_schema is required"),
        (chat_body(response_format={"type": "json_schema", "json_schema": {
            "name": "a b"}}), "response_format.json_schema.name", "should match pattern"),
        (chat_body(response_format={"type": "json_schema", "json_schema": {
            "name": "n", "schema": [1]}}), "response_format.json_schema.schema",
         "a JSON schema must be an object"),
        (chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
                   tool_choice={"type": "function", "function": {"name": "g"}}),
         "tool_choice.function.name", "'g' is not one of the declared tools"),
        (chat_body(tool_choice="required"), "tool_choice", "needs tools"),
        (chat_body(tool_choice="sometimes"), "tool_choice",
         "expected 'none', 'auto', 'required' or {'type': 'function'"),
        (chat_body(tool_choice={"type": "function", "name": "f"}), "tool_choice",
         "got {'name': 'f', 'type': 'function'}"),
        (chat_body(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "tools",
         "declared twice"),
        (chat_body(tools=[{"type": "function", "function": {"name": "f g"}}]),
         "tools[0].function.name", "should match pattern"),
        (chat_body(tools=[{"type": "code_interpreter"}]), "tools[0].type",
         "Input should be 'function'"),
        (chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}]),
         "tools[0].function.parameters", "a JSON schema must be an object"),
        (chat_body(messages=[{"role": "assistant", "tool_calls": [{"id": "c"}]}]),
         "messages[0].tool_calls[0].function", "Field required"),
        (chat_body(cache={"removed_reasoning": "sometimes"}), "cache.removed_reasoning",
         "expected one of 'as_sent', 'drop'"),
        (chat_body(tools=["x"]), "tools[0]", "should be an object, got 'x'"),
        (chat_body(reasoning_effort="max"), "reasoning_effort", "'low', 'medium' or 'high'"),
        (chat_body(chat_template_kwargs=[1]), "chat_template_kwargs",
         "should be an object, got [1]"),
        (chat_body(chat_template_kwargs={"messages": []}), "chat_template_kwargs",
         "messages is set by the server"),
    ],
)
def test_chat_rejections(body, field, words):
    err = rejected(protocol.parse_chat, body)
    assert err.field == field
    assert words in err.message
    assert not isinstance(err, CacheOpError)  # the cache is checked once segments are known


def test_chat_template_variables_pass_through():
    """chat_template_kwargs reach the template, with the request's own tools and
    reasoning_effort beside them (those win: they are the request's named fields)."""
    inp = protocol.parse_chat(
        chat_body(chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"},
                  reasoning_effort="high", tools=[{"type": "function", "function": {
                      "name": "f", "parameters": {"type": "object"}}}]),
        LIMITS, VOCAB,
    )
    assert inp.template_kwargs == {"enable_thinking": False, "reasoning_effort": "high",
                                   "tools": [{"type": "function", "function": {
                                       "name": "f", "parameters": {"type": "object"}}}]}
    assert protocol.parse_chat(chat_body(), LIMITS, VOCAB).template_kwargs == {}


def test_chat_history_indices_are_message_indices():
    # 2 messages + the generation-prompt segment: ops may name only the 2 messages.
    with pytest.raises(CacheOpError) as info:
        protocol.chat_history({"drop": {"2": [0]}}, 2, 3)
    assert info.value.field == 'cache.drop["2"]'
    assert "boundary 2 out of range [0, 2)" in info.value.message


def test_generation_starts_at_the_timelines_next_pos():
    # What the chat route's default max_tokens is clipped by (``max_position - next_pos``).
    lens = [3, 4, 2, 5]
    assert timeline(lens, OpHistory.empty(4)).next_pos == 14
    # drop alone does not compact (DESIGN §2 Figure 10)
    assert timeline(lens, OpHistory(4, {2: (1,)}, ())).next_pos == 14
    # drop 1 then repos at 2: 3 + 2 active, then segment 3 appended
    assert timeline(lens, OpHistory(4, {2: (1,)}, (2,))).next_pos == 5 + 5
    assert timeline(lens, OpHistory(4, {3: (0, 3)}, (3,))).next_pos == 4 + 2


def test_errors_are_json_serialisable():
    err = rejected(protocol.parse_generate, {"input_ids": [[1], [2]], "cache": {"drop": {
        "1": ["\u00e9"]}}})
    assert json.loads(json.dumps({"message": str(err), "param": err.field}))["param"] == (
        'cache.drop["1"][0]'
    )


@pytest.mark.parametrize(
    "loc, field",
    [
        (("input_ids", 2, 5), "input_ids[2][5]"),
        (("messages", 3, "content"), "messages[3].content"),
        (("messages", 0, "content", 1, "text"), "messages[0].content[1].text"),
        (("sampling_params", "top_p"), "sampling_params.top_p"),
        (("cache", "drop", "5", 1), 'cache.drop["5"][1]'),
        (("stop", 0), "stop[0]"),
        ((), ""),
    ],
)
def test_pydantic_locations_in_api_notation(loc, field):
    assert field_path(loc) == field


def test_schema_errors_name_the_first_problem_and_its_value():
    # Several problems: the first one in field order is reported, with the value at fault
    # (a long one abbreviated).
    err = rejected(protocol.parse_chat, chat_body(
        messages=[{"role": "user", "content": "x"}, {"role": "user", "content": 3}],
        model=7, stream=[1] * 1000))
    assert err.field == "messages[1].content"
    err = rejected(protocol.parse_chat, chat_body(model=7, stream=[1] * 1000))
    assert err.field == "model" and err.message == "Input should be a valid string, got 7"
    err = rejected(protocol.parse_generate, {"input_ids": [1], "stream": ["y" * 500] * 100})
    assert err.field == "stream"
    assert err.message.startswith("Input should be a valid boolean, got ['yyy")
    assert len(err.message) < 200
    # a body that is not an object names the body
    with pytest.raises(InvalidField) as info:
        protocol.parse_generate([1, 2], LIMITS, VOCAB)
    assert info.value.field == "body"


def test_chat_messages_keep_their_keys_for_the_template():
    msg = {"role": "tool", "content": [{"type": "text", "text": "42", "extra": 1}],
           "tool_call_id": "c1", "name": None, "custom": {"k": [1]}}
    inp = protocol.parse_chat(chat_body(messages=[msg]), LIMITS, VOCAB)
    assert inp.messages == [{"role": "tool", "content": "42", "tool_call_id": "c1",
                             "name": None, "custom": {"k": [1]}}]
    assert "tool_calls" not in inp.messages[0]  # no keys the client did not send


def test_sampling_fields_become_the_engines_params():
    # -1 is top-k off, as 0; integral floats are integers; the ranges are the sampler's
    inp = gen({"input_ids": [1], "sampling_params": {"top_k": -1, "seed": 3.0}})
    assert inp.sampling == SamplingParams(max_new_tokens=16, top_k=0, seed=3)
    inp = protocol.parse_chat(chat_body(top_k=5, stop_token_ids=[7], ignore_eos=True,
                                        max_tokens=9), LIMITS, VOCAB)
    assert inp.sampling == SamplingParams(max_new_tokens=9, top_k=5, stop_token_ids=(7,),
                                          ignore_eos=True)
    for body, field in [({"top_p": 1.5}, "sampling_params.top_p"),
                        ({"temperature": -0.5}, "sampling_params.temperature")]:
        err = rejected(protocol.parse_generate, {"input_ids": [1], "sampling_params": body})
        assert err.field == field and not isinstance(err, CacheOpError)


def test_openapi_schema_of_the_bodies():
    gen_schema = GenerateBody.model_json_schema()
    assert gen_schema["required"] == ["input_ids"]
    assert gen_schema["additionalProperties"] is False
    assert set(gen_schema["properties"]) == {"input_ids", "cache", "sampling_params",
                                             "return_logprob", "stream"}
    chat_schema = ChatBody.model_json_schema()
    assert "messages" in chat_schema["required"]
    content = chat_schema["$defs"]["Message"]["properties"]["content"]
    assert {"type": "string"} in content["anyOf"]  # a string or a list of text parts
