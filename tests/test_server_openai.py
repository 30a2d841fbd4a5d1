"""/v1/chat/completions from the official ``openai`` client, against the tiny model server.

The tiny model has a byte-level ChatML tokenizer, so chat works end to end (its replies are
random bytes: the tests compare replies with each other, never with expected prose).
"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_support import shared_server

from akv_jax.model.tokenizer import ChatTokenizer

TOK = ChatTokenizer.byte_level_chatml(512)  # the tiny model's tokenizer, built cheaply here
SYSTEM = {"role": "system", "content": "You are a helpful assistant that answers."}
USER1 = {"role": "user", "content": "Tell me about the weather today."}
USER2 = {"role": "user", "content": "and tomorrow?"}


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def prompt_len(messages: list[dict]) -> int:
    return sum(len(s) for s in TOK.encode_messages(messages, add_generation_prompt=True))


def chat(client: openai.OpenAI, messages: list[dict], **kw):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_chat_non_stream(client, server):
    # From an empty cache nothing is cached (the shared server has seen this prompt before).
    assert httpx.post(server.url + "/flush_cache", timeout=120).json() == {"flushed": True}
    resp = chat(client, [SYSTEM, USER1], max_tokens=6)
    assert resp.object == "chat.completion" and resp.model == "tiny"
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == prompt_len([SYSTEM, USER1])
    assert resp.usage.completion_tokens == 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    # The same prompt through /generate, as segments (messages + generation prompt), gives
    # the same tokens: the content is their text. It finds the chat's KV resident: all but
    # the last segment is cached (that one is recomputed for the logits).
    segments = TOK.encode_messages([SYSTEM, USER1], add_generation_prompt=True)
    out = httpx.post(server.url + "/generate", timeout=120, json={
        "input_ids": segments, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert out.json()["meta_info"]["cached_tokens"] == resp.usage.prompt_tokens - len(
        segments[-1])
    assert choice.message.content == TOK.decode(out.json()["output_ids"],
                                                skip_special_tokens=True)


def test_chat_stream_matches_non_stream(client):
    whole = chat(client, [SYSTEM, USER1], max_tokens=6)
    stream = chat(client, [SYSTEM, USER1], max_tokens=6, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    # without include_usage no chunk carries usage
    plain = list(chat(client, [SYSTEM, USER1], max_tokens=6, stream=True))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_extra_body_cache_multi_turn(client):
    turn1 = chat(client, [SYSTEM, USER1], max_tokens=4)
    history = [SYSTEM, USER1, {"role": "assistant", "content": "OK."}, USER2]
    # Turn 2 drops USER1 (message 1) after USER2 arrives (boundary 3).
    turn2 = chat(client, history, max_tokens=4, extra_body={"cache": {"drop": {"3": [1]}}})
    n_prompt = prompt_len(history)
    assert turn2.usage.prompt_tokens == n_prompt
    # Turn 1's whole prompt is reused: its generation prompt is a prefix of the assistant
    # message "<|im_start|>assistant\n...", and turn 1 computed it with no ops.
    assert turn2.usage.prompt_tokens_details.cached_tokens == turn1.usage.prompt_tokens
    user1_len = len(TOK.encode_messages([SYSTEM, USER1])[1])
    assert turn2.model_extra["meta_info"]["active_tokens"] == n_prompt - user1_len + 4
    # A drop plus reposition is accepted too, and changes what the reply attends to.
    turn2r = chat(client, history, max_tokens=4, logprobs=True,
                  extra_body={"cache": {"drop": {"3": [1, 2]}, "reposition": [3]}})
    plain = chat(client, history, max_tokens=4, logprobs=True)
    assert [t.logprob for t in turn2r.choices[0].logprobs.content] != [
        t.logprob for t in plain.choices[0].logprobs.content]


def test_invalid_cache_is_400(client):
    msgs = [SYSTEM, USER1, USER2]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, msgs, max_tokens=2, extra_body={"cache": {"drop": {"5": [0]}}})
    err = info.value.response.json()["error"]
    assert err["param"] == 'cache.drop["5"]'
    assert err["message"] == 'cache.drop["5"]: boundary 5 out of range [0, 3)'
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, msgs, max_tokens=2, extra_body={"cache": {"drop": {"1": [2]}}})
    assert info.value.response.json()["error"]["param"] == 'cache.drop["1"][0]'
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, msgs, max_tokens=2, n=2)
    assert info.value.response.json()["error"]["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, msgs, max_tokens=5000, extra_body={"cache": None})
    assert "add a reposition" in info.value.response.json()["error"]["message"]
    # still serving
    assert chat(client, msgs, max_tokens=2).usage.completion_tokens == 2


def test_stop_string_and_logprobs(client):
    whole = chat(client, [SYSTEM, USER1], max_tokens=12, logprobs=True)
    content = whole.choices[0].message.content
    lps = whole.choices[0].logprobs.content
    assert len(lps) == whole.usage.completion_tokens == 12
    assert all(t.logprob < 0 and t.top_logprobs == [] for t in lps)
    # a stop string taken from the middle of the reply ends it just before that text
    start = next(i for i in range(1, len(content) - 2) if content[i:i + 3].isascii())
    stop = content[start:start + 3]
    expected = content[: content.index(stop)]
    cut = chat(client, [SYSTEM, USER1], max_tokens=12, stop=[stop])
    assert cut.choices[0].message.content == expected
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 12
    streamed = chat(client, [SYSTEM, USER1], max_tokens=12, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
