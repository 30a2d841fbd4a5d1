"""Tokenizer + chat template against transformers' apply_chat_template / encode (golden ids)."""

from __future__ import annotations

import pytest
from golden import smollm2_meta

from akv_jax.model.tokenizer import ChatTokenizer
from converters.loading import default_gguf_path, default_model_dir

CHATS = smollm2_meta()["chats"]


@pytest.fixture(scope="module")
def gguf_tokenizer():
    """Built directly from the GGUF metadata (what the converter saves as tokenizer.json)."""
    import gguf

    from converters.sources import read_gguf_metadata

    return ChatTokenizer.from_gguf_metadata(
        read_gguf_metadata(gguf.GGUFReader(default_gguf_path()))
    )


@pytest.fixture(scope="module")
def saved_tokenizer(default_model_cache):
    """Loaded back from the converted default model's tokenizer.json / tokenizer_config.json."""
    return ChatTokenizer.from_dir(default_model_dir())


@pytest.fixture(params=["gguf", "saved"])
def tok(request, gguf_tokenizer, saved_tokenizer):
    return gguf_tokenizer if request.param == "gguf" else saved_tokenizer


@pytest.mark.parametrize("chat", CHATS, ids=[c["name"] for c in CHATS])
def test_segments_concatenate_to_apply_chat_template(tok, chat):
    for agp, key in ((False, "ids"), (True, "ids_gen")):
        segments = tok.encode_messages(chat["messages"], add_generation_prompt=agp)
        assert len(segments) == len(chat["messages"]) + int(agp)
        assert all(segments)
        assert [t for s in segments for t in s] == chat[key]
        assert tok.apply_chat_template(chat["messages"], agp) == chat[key]


@pytest.mark.parametrize("chat", CHATS, ids=[c["name"] for c in CHATS])
def test_segments_are_stable_when_messages_are_appended(tok, chat):
    """Each message's tokens are the same whatever follows it (cache prefixes stay valid),
    and each prefix conversation's segments concatenate to a prefix of the golden ids."""
    full = tok.encode_messages(chat["messages"])
    for i in range(1, len(chat["messages"])):
        part = tok.encode_messages(chat["messages"][:i])
        assert part == full[:i]
        flat = [t for s in part for t in s]
        assert chat["ids"][: len(flat)] == flat


def test_generation_prompt_segment(tok):
    chat = CHATS[0]
    gen = tok.generation_prompt_segment()
    assert gen == chat["ids_gen"][len(chat["ids"]) :]
    assert tok.encode_messages(chat["messages"], add_generation_prompt=True)[-1] == gen


def test_plain_text_encode_and_decode(tok):
    for text, ids in smollm2_meta()["texts"].items():
        assert tok.encode(text) == ids
        assert tok.decode(ids) == text


def test_special_tokens_and_eos(tok):
    meta = smollm2_meta()
    assert tok.eos_ids == (meta["eos_token_id"],)
    assert tok.token_to_id(tok.bos_token) == meta["bos_token_id"]
    # Generated text decodes with the end-of-turn marker removed when asked.
    cont = CHATS[0]["continuation"]
    assert "<|im_end|>" in tok.decode(cont)
    assert "<|im_end|>" not in tok.decode(cont, skip_special_tokens=True)


def test_tiny_byte_tokenizer_round_trip():
    tok = ChatTokenizer.byte_level_chatml(512)
    text = "naïve café — 東京 🙂\n\tend"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    segs = tok.encode_messages(msgs, add_generation_prompt=True)
    assert [t for s in segs for t in s] == tok.apply_chat_template(msgs, True)
    assert segs[0][0] == tok.token_to_id("<|im_start|>") == 510
    assert tok.eos_ids == (511,)


def test_segments_when_old_reasoning_is_dropped():
    """A Qwen3-style template keeps an assistant turn's reasoning only after the last user
    message: each message's segment is still its text in the full rendering."""
    tmpl = (
        "{% set ns = namespace(last_user=-1) %}{% for m in messages %}"
        "{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user %}"
        "<think>{{ m.reasoning_content }}</think>\n{% endif %}{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    byte = ChatTokenizer.byte_level_chatml(512)
    tok = ChatTokenizer(byte.tokenizer, tmpl, byte.special_tokens)
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "think b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "reasoning_content": "think d"},
    ]
    assert "think b" in tok.render(msgs[:2]) and "think b" not in tok.render(msgs)
    segs = tok.encode_messages(msgs, add_generation_prompt=True)
    assert [tok.decode(s) for s in segs] == [
        "<|im_start|>user\na<|im_end|>\n",
        "<|im_start|>assistant\nb<|im_end|>\n",
        "<|im_start|>user\nc<|im_end|>\n",
        "<|im_start|>assistant\n<think>think d</think>\nd<|im_end|>\n",
        "<|im_start|>assistant\n",
    ]
