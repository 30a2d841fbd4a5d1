"""A reply sent back as history: its recorded ids (reply_record.py) and reasoning left out of
it served as a drop (removed_reasoning.py), on the real Qwen3 and o200k_harmony vocabularies,
where tokenizing a reply's text again need not give the ids the model generated."""

from __future__ import annotations

import pytest

from akv_jax.cache.ops import OpHistory, parse_history
from akv_jax.model.tokenizer import ChatTokenizer
from akv_jax.model.vocabularies import o200k_harmony_tokenizer, qwen3_tokenizer
from akv_jax.serving.removed_reasoning import removed_span, segment_history
from akv_jax.serving.reply_record import (
    ReplyRecord,
    as_generated,
    message_key,
    partly_generated,
    reply_key,
)


@pytest.fixture(scope="module")
def qwen3():
    return ChatTokenizer(qwen3_tokenizer(), None, {"eos_token": "<|im_end|>"})


@pytest.fixture(scope="module")
def harmony():
    tok = o200k_harmony_tokenizer()
    return ChatTokenizer(tok, None, {"eos_token": "<|return|>"},
                         extra_eos_ids=[tok.token_to_id("<|call|>")])


def spelled(tok: ChatTokenizer, *pieces: str) -> list[int]:
    """Ids that spell ``pieces`` one by one: how a model may well have generated them."""
    return [t for p in pieces for t in tok.encode(p)]


def test_recorded_ids_replace_a_retokenization(qwen3):
    gen_prompt = qwen3.encode("<|im_start|>assistant\n")
    generated = spelled(qwen3, "hel", "lo", " wor", "ld", "<|im_end|>")
    text = "<|im_start|>assistant\nhello world<|im_end|>\n"
    segment = qwen3.encode(text)
    assert segment[: len(gen_prompt) + 4] != [*gen_prompt, *generated[:4]]  # BPE merged
    got = as_generated(segment, [*gen_prompt, *generated], qwen3)
    assert got[: len(gen_prompt) + len(generated)] == [*gen_prompt, *generated]
    assert qwen3.decode(got) == text  # the text is unchanged: only its tokenization


def test_recorded_ids_without_their_stop_token(harmony):
    """GPT-OSS ends a final answer with <|return|>; resent, it renders <|end|>: the reply
    up to the stop token is kept, the template's own ending follows it."""
    gp = harmony.encode("<|start|>assistant")
    generated = spelled(harmony, "<|channel|>final<|message|>", "Sun", "ny", "<|return|>")
    segment = harmony.encode("<|start|>assistant<|channel|>final<|message|>Sunny<|end|>")
    got = as_generated(segment, [*gp, *generated], harmony)
    assert got == [*gp, *generated[:-1], *harmony.encode("<|end|>")]


def test_a_different_text_is_left_alone(qwen3):
    gp = qwen3.encode("<|im_start|>assistant\n")
    segment = qwen3.encode("<|im_start|>assistant\nhello there<|im_end|>\n")
    assert as_generated(segment, [*gp, *spelled(qwen3, "hello", " world")], qwen3) is segment


def test_a_reply_rendered_otherwise_keeps_its_common_prefix(qwen3):
    """MiniMax-M2's template renders a newline before a call block that the model did not
    write: the generated ids are kept up to where the texts part, the rest re-tokenized."""
    gp = qwen3.encode("<|im_start|>assistant\n")
    generated = [*gp, *spelled(qwen3, "<think>\n", "hm", "m\n</think>\n\n", "<tool_call>", "x")]
    text = "<|im_start|>assistant\n<think>\nhmm\n</think>\n\n\n<tool_call>x<|im_end|>\n"
    segment = qwen3.encode(text)
    assert as_generated(segment, generated, qwen3) is segment
    got = partly_generated(segment, generated, qwen3)
    assert qwen3.decode(got) == text
    kept = len(generated) - 2  # all but "<tool_call>" and "x"
    assert got[:kept] == generated[:kept] and got[kept] != generated[kept]
    assert partly_generated(segment, qwen3.encode("nothing alike"), qwen3) is segment


def test_record_keys_and_bound():
    rec = ReplyRecord(capacity=2)
    calls = {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "f", "arguments": "{}"}}]}
    assert message_key(calls) == reply_key(None, ["call_1"]) == ("calls", "call_1")
    assert message_key({"role": "assistant", "content": "hi"}) == ("content", "hi")
    assert message_key({"role": "assistant", "content": ""}) is None
    rec.remember(("calls", "call_1"), [1, 2])
    rec.remember(("content", "hi"), [3])
    assert rec.lookup(("calls", "call_1")).ids == (1, 2)  # now the most recent
    rec.remember(("content", "x"), [4])
    assert rec.lookup(("content", "hi")) is None and len(rec) == 2


def test_removed_think_block_is_one_span(qwen3):
    gp = qwen3.encode("<|im_start|>assistant\n")
    generated = spelled(qwen3, "<think>", "\nLet me call it.\n", "</think>", "\n\n",
                        "<tool_call>", '\n{"name": "f", "arguments": {}}\n', "</tool_call>",
                        "<|im_end|>")
    sent = '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>' \
           "<|im_end|>\n"
    pre, removed, post = removed_span([*gp, *generated], qwen3.encode(sent), qwen3)
    assert pre == gp
    assert qwen3.decode(removed) == "<think>\nLet me call it.\n</think>\n\n"
    assert qwen3.decode(pre) + qwen3.decode(post) == sent
    assert [*pre, *removed, *post][: len(gp) + len(generated)] == [*gp, *generated]


def test_removed_analysis_in_harmony(harmony):
    gp = harmony.encode("<|start|>assistant")
    generated = spelled(harmony, "<|channel|>analysis<|message|>", "It is sunny.", "<|end|>",
                        "<|start|>assistant<|channel|>final<|message|>", "Sunny.", "<|return|>")
    sent = "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
    pre, removed, post = removed_span([*gp, *generated], harmony.encode(sent), harmony)
    assert harmony.decode(pre) + harmony.decode(post) == sent
    assert "It is sunny." in harmony.decode(removed)
    assert [*pre, *removed, *post][: len(gp) + len(generated) - 1] == [*gp, *generated[:-1]]


def test_no_span_when_the_text_differs(qwen3):
    gp = qwen3.encode("<|im_start|>assistant\n")
    generated = spelled(qwen3, "<think>", "x", "</think>", "\n\nabc", "<|im_end|>")
    sent = qwen3.encode("<|im_start|>assistant\nabd<|im_end|>\n")
    assert removed_span([*gp, *generated], sent, qwen3) is None


def test_segment_history_keeps_message_indices():
    """Messages 0..4 and the generation prompt (5); message 2 is split into segments 2
    (pre), 3 (removed) and 4 (post), so later messages shift by two."""
    message_segments = [[0], [1], [2, 3, 4], [5], [6], [7]]
    removed = {3: 4}
    h = parse_history({"drop": {"3": [1], "4": [2]}, "reposition": [2, 4]}, 6)
    got = segment_history(h, message_segments, removed, 8)
    assert got == OpHistory(8, {4: (3,), 5: (1,), 6: (2, 4)}, (4, 6))
    # Without client ops only the removed segment is dropped, after its message.
    assert segment_history(OpHistory.empty(6), message_segments, removed, 8) == OpHistory(
        8, {4: (3,)}, ())
