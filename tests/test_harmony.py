"""GPT-OSS chat: the harmony format through ChatTokenizer's per-message segments.

The vocabulary is o200k_harmony as bundled by ``quicktok-v1`` (read from its data files and
rebuilt as a ``tokenizers`` BPE by :func:`akv_jax.model.byte_bpe.tiktoken_tokenizer`); the
chat template is akv_jax's harmony template (:mod:`akv_jax.model.harmony_template`, the one
``tiny-gpt-oss`` chats with over its byte vocabulary, tested here too); the oracle for the
token ids is ``openai-harmony``, the format's reference renderer, run offline on the same
vocabulary (written as the ``o200k_base.tiktoken`` file it would download; its
SHA-256 is the published one). Both packages are dev dependencies: without them these tests
fail at import, they are not skipped.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from pathlib import Path

import pytest
import quicktok

from akv_jax.model.byte_bpe import O200K_SPLIT, tiktoken_tokenizer
from akv_jax.model.harmony_template import HARMONY_SPECIALS, HARMONY_TEMPLATE
from akv_jax.model.tokenizer import ChatTokenizer, TokenizerError
from converters.loading import load_model

TEMPLATE = HARMONY_TEMPLATE
# The SHA-256 of openaipublic's o200k_base.tiktoken (the file openai-harmony downloads).
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def read_quicktok_encoding(name: str, vocab: str) -> tuple[dict[bytes, int], dict[str, int]]:
    """quicktok's bundled data files: ``<vocab>.vocab`` (u32 count, then per token u16 length,
    bytes, u32 rank) and ``<name>.special`` (u32 count, then per token u32 id, u16 length,
    UTF-8 name). A special id listed under a reserved name and a real one keeps the real one."""
    data = Path(quicktok.__file__).parent / "data"
    raw = (data / f"{vocab}.vocab").read_bytes()
    (n,), off, ranks = struct.unpack_from("<I", raw), 4, {}
    for _ in range(n):
        (length,) = struct.unpack_from("<H", raw, off)
        token = raw[off + 2 : off + 2 + length]
        (ranks[token],) = struct.unpack_from("<I", raw, off + 2 + length)
        off += 6 + length
    assert off == len(raw)
    raw = (data / f"{name}.special").read_bytes()
    (n,), off, specials = struct.unpack_from("<I", raw), 4, []
    for _ in range(n):
        tid, length = struct.unpack_from("<IH", raw, off)
        specials.append((raw[off + 6 : off + 6 + length].decode(), tid))
        off += 6 + length
    assert off == len(raw)
    specials.sort(key=lambda s: s[0].startswith("<|reserved_"))
    return ranks, dict(specials)


@pytest.fixture(scope="module")
def o200k_harmony():
    return read_quicktok_encoding("o200k_harmony", "o200k")


@pytest.fixture(scope="module")
def tok(o200k_harmony):
    """GPT-OSS's tokenizer (special tokens as in its tokenizer_config.json and
    generation_config.json: EOS <|return|>, also <|call|> and <|endoftext|>)."""
    ranks, specials = o200k_harmony
    special = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
    }
    return ChatTokenizer(
        tiktoken_tokenizer(ranks, specials, O200K_SPLIT),
        TEMPLATE,
        special,
        extra_eos_ids=[specials["<|call|>"], specials["<|endoftext|>"]],
    )


@pytest.fixture(scope="module")
def harmony(o200k_harmony, tmp_path_factory):
    """openai-harmony's GPT-OSS encoding, loaded offline from the quicktok vocabulary."""

    ranks, _ = o200k_harmony
    d = tmp_path_factory.mktemp("tiktoken")
    text = "".join(
        f"{base64.b64encode(t).decode()} {r}\n"
        for t, r in sorted(ranks.items(), key=lambda x: x[1])
    )
    assert hashlib.sha256(text.encode()).hexdigest() == O200K_BASE_SHA256
    (d / "o200k_base.tiktoken").write_text(text)
    mp = pytest.MonkeyPatch()
    mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(d))
    mp.setenv("TIKTOKEN_RS_CACHE_DIR", str(d / "cache"))
    try:
        import openai_harmony

        yield (
            openai_harmony,
            openai_harmony.load_harmony_encoding(
                openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS
            ),
        )
    finally:
        mp.undo()


def weather_call(city):
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


# An agent conversation: a tool call with reasoning, its result, a final answer with
# reasoning, a second question and a second tool call.
AGENT = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "thinking": "I should call the tool.",
        "tool_calls": [weather_call("Paris")],
    },
    {"role": "tool", "content": '{"temp": 21, "sky": "sunny"}'},
    {"role": "assistant", "content": "Sunny, 21 °C.", "thinking": "It is sunny and 21."},
    {"role": "user", "content": "And in Tokyo — 東京?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Call it again.",
        "tool_calls": [weather_call("Tokyo")],
    },
    {"role": "tool", "content": '{"temp": 9}'},
]

SYSTEM = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: {effort}\n\n# Valid channels: analysis, "
    "commentary, final. Channel must be included for every message.<|end|>"
)
CALL = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{{"city": "{city}"}}<|call|>'
)
TOOL = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{}<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Sunny, 21 °C."
# Each message's text in the full rendering of AGENT (with the generation prompt): its last
# assistant message is a tool call, so every turn keeps its reasoning.
AGENT_TEXTS = [
    SYSTEM.format(effort="medium")
    + "<|start|>developer<|message|># Instructions\n\nAnswer briefly.<|end|>",
    "<|start|>user<|message|>What's the weather in Paris?<|end|>",
    "<|start|>assistant<|channel|>analysis<|message|>I should call the tool.<|end|>"
    + CALL.format(city="Paris"),
    TOOL.format('{"temp": 21, "sky": "sunny"}'),
    "<|start|>assistant<|channel|>analysis<|message|>It is sunny and 21.<|end|>"
    + FINAL
    + "<|end|>",
    "<|start|>user<|message|>And in Tokyo — 東京?<|end|>",
    "<|start|>assistant<|channel|>analysis<|message|>Call it again.<|end|>"
    + CALL.format(city="Tokyo"),
    TOOL.format('{"temp": 9}'),
    "<|start|>assistant",
]
# AGENT[:6] ends after a final answer: the reasoning up to it is dropped.
ANSWERED_TEXTS = [
    *AGENT_TEXTS[:2],
    CALL.format(city="Paris"),
    AGENT_TEXTS[3],
    FINAL + "<|end|>",
    AGENT_TEXTS[5],
    "<|start|>assistant",
]


def test_tokenizer_equals_quicktok(tok):
    """The rebuilt BPE gives quicktok's (= tiktoken's) ids, special tokens included."""
    enc = quicktok.get_encoding("o200k_harmony")
    texts = [
        "Hello, world! don't can't I'll 'TWAS",
        "def f(x):\n    return [i**2 for i in range(100)]  # 1+2+3==6\r\n\t end  ",
        "naïve café — Zürich 日本語のトークナイザー 한국어 Ω≈ç√∫ हिन्दी 🚀🔥👍 0xDEADBEEF 3.14159",
        "ALLCAPSWord camelCaseWord https://example.com/a/b?q=1&x=2 <html>\n\n\n   x",
        "".join(AGENT_TEXTS),
    ]
    for text in texts:
        ids = tok.encode(text)
        assert ids == list(enc.encode(text, allowed_special="all"))
        assert tok.decode(ids) == text
    assert tok.eos_ids == (200002, 200012, 199999)
    assert tok.vocab_size == 201088


def test_agent_segments_are_the_messages(tok):
    """One segment per message, each exactly that message's text in the full rendering,
    also where the template renders earlier assistant turns differently depending on what
    follows them (so the prefix renderings are not prefixes of the full one)."""
    for msgs, texts in ((AGENT, AGENT_TEXTS), (AGENT[:6], ANSWERED_TEXTS)):
        for agp in (True, False):
            segments = tok.encode_messages(msgs, add_generation_prompt=agp)
            assert [t for s in segments for t in s] == tok.apply_chat_template(msgs, agp)
            assert [tok.decode(s) for s in segments] == (texts if agp else texts[:-1])
    # The cases being tested: message 2's reasoning is in the rendering that ends with it, not
    # in AGENT[:6]'s; message 4's is not in the rendering that ends with it (with the
    # generation prompt), but is in AGENT's.
    assert not tok.render(AGENT[:6]).startswith(tok.render(AGENT[:3]))
    assert "I should call the tool." in tok.render(AGENT[:3])
    assert not tok.render(AGENT).startswith(tok.render(AGENT[:5], True))


def test_last_assistant_message_keeps_reasoning_and_returns(tok):
    """The conversation's last assistant message, with no generation prompt after it, is in
    the training form (reasoning kept, <|return|>); with a generation prompt it is not."""
    msgs = AGENT[:5]
    segs = tok.encode_messages(msgs)
    assert tok.decode(segs[-1]) == (
        "<|start|>assistant<|channel|>analysis<|message|>It is sunny and 21.<|end|>"
        + FINAL
        + "<|return|>"
    )
    assert [tok.decode(s) for s in segs[:-1]] == ANSWERED_TEXTS[:4]
    segs = tok.encode_messages(msgs, add_generation_prompt=True)
    assert [tok.decode(s) for s in segs] == ANSWERED_TEXTS[:5] + ["<|start|>assistant"]
    assert segs[-1] == tok.generation_prompt_segment() == [200006, 173781]


def test_which_segments_are_stable(tok):
    """Segments of a prefix conversation are the longer one's while the template renders the
    shared messages alike: before the final answer, and after the next tool call. Harmony
    drops the reasoning only while a final answer is the last assistant message, so turns 2
    and 4 differ between AGENT[:6] and AGENT (a cache miss for them, by the format)."""
    part = tok.encode_messages(AGENT[:4])
    for i in range(1, 4):
        assert tok.encode_messages(AGENT[:i]) == part[:i]
    full = tok.encode_messages(AGENT)
    assert tok.encode_messages(AGENT[:7]) == full[:7]
    answered = tok.encode_messages(AGENT[:6])
    assert [i for i in range(6) if answered[i] != full[i]] == [2, 4]


def test_reasoning_effort_and_template_kwargs_change_the_system_segment(tok):
    base = tok.encode_messages(AGENT, add_generation_prompt=True)
    for effort in ("low", "high"):
        segs = tok.encode_messages(AGENT, add_generation_prompt=True, reasoning_effort=effort)
        assert tok.decode(segs[0]).startswith(SYSTEM.format(effort=effort))
        assert segs[1:] == base[1:]
    segs = tok.encode_messages(
        AGENT,
        add_generation_prompt=True,
        conversation_start_date="2026-12-01",
        model_identity="You are a test.",
        tools=[weather_call("x")],
    )
    assert tok.decode(segs[0]).startswith(
        "<|start|>system<|message|>You are a test.\nKnowledge cutoff: 2024-06\n"
        "Current date: 2026-12-01\n\nReasoning: medium\n\n# Valid channels: analysis, "
        "commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    )
    assert segs[1:] == base[1:]


def to_harmony(h, messages, reasoning_effort="medium", date=None):
    """The same conversation as openai-harmony messages."""
    effort = {
        "low": h.ReasoningEffort.LOW,
        "medium": h.ReasoningEffort.MEDIUM,
        "high": h.ReasoningEffort.HIGH,
    }[reasoning_effort]
    system = h.SystemContent.new().with_reasoning_effort(effort)
    if date is not None:
        system = system.with_conversation_start_date(date)
    out = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    for m in messages:
        if m["role"] == "developer":
            out.append(
                h.Message.from_role_and_content(
                    h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(m["content"])
                )
            )
        elif m["role"] == "user":
            out.append(h.Message.from_role_and_content(h.Role.USER, m["content"]))
        elif m["role"] == "assistant":
            thinking = m.get("thinking") or m.get("reasoning_content")
            if thinking:
                out.append(
                    h.Message.from_role_and_content(h.Role.ASSISTANT, thinking).with_channel(
                        "analysis"
                    )
                )
            for call in m.get("tool_calls", []):
                f = call["function"]
                out.append(
                    h.Message.from_role_and_content(h.Role.ASSISTANT, json.dumps(f["arguments"]))
                    .with_channel("commentary")
                    .with_recipient(f"functions.{f['name']}")
                    .with_content_type("<|constrain|>json")
                )
            if m["content"]:
                out.append(
                    h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"]).with_channel(
                        "final"
                    )
                )
        elif m["role"] == "tool":
            out.append(
                h.Message.from_author_and_content(
                    h.Author.new(h.Role.TOOL, "functions.get_weather"), m["content"]
                )
                .with_channel("commentary")
                .with_recipient("assistant")
            )
    return h.Conversation.from_messages(out)


@pytest.mark.parametrize("n", range(2, len(AGENT) + 1))
@pytest.mark.parametrize("effort", ["low", "high"])
def test_ids_equal_openai_harmony(tok, harmony, n, effort):
    """The oracle: for every prefix of the agent conversation, our segments (with the
    generation prompt) concatenate to openai-harmony's render_conversation_for_completion."""
    h, enc = harmony
    expect = enc.render_conversation_for_completion(
        to_harmony(h, AGENT[:n], effort, date="2026-12-01"), h.Role.ASSISTANT
    )
    segs = tok.encode_messages(
        AGENT[:n],
        add_generation_prompt=True,
        reasoning_effort=effort,
        conversation_start_date="2026-12-01",
    )
    assert [t for s in segs for t in s] == list(expect)


@pytest.fixture(scope="module")
def tiny_gpt_oss_tok():
    return load_model("tiny-gpt-oss").tokenizer


def test_tiny_gpt_oss_chats_in_harmony(tiny_gpt_oss_tok, o200k_harmony):
    t = tiny_gpt_oss_tok
    assert t.chat_template == HARMONY_TEMPLATE
    # One id per harmony special token, at the end of the byte vocabulary; <|return|> is the
    # EOS (the config's too), <|call|> and <|endoftext|> end a generation, as in GPT-OSS.
    ids = [t.token_to_id(s) for s in HARMONY_SPECIALS]
    assert ids == list(range(512 - len(HARMONY_SPECIALS), 512))
    assert set(HARMONY_SPECIALS) <= set(o200k_harmony[1])  # the real vocabulary's names
    assert t.eos_ids == (511, t.token_to_id("<|call|>"), t.token_to_id("<|endoftext|>"))
    assert load_model("tiny-gpt-oss").stop_ids[0] == 511


@pytest.mark.parametrize("n", [2, 3, 5, 6, len(AGENT)])
def test_tiny_gpt_oss_renders_what_openai_harmony_renders(tiny_gpt_oss_tok, tok, harmony, n):
    """tiny-gpt-oss's chat, over bytes, is openai-harmony's rendering: its segments decode to
    the text of openai-harmony's ids (decoded with the o200k_harmony vocabulary), one segment
    per message as with the real vocabulary, every special token a single id."""
    h, enc = harmony
    expect = enc.render_conversation_for_completion(
        to_harmony(h, AGENT[:n], "high", date="2026-12-01"), h.Role.ASSISTANT
    )
    t = tiny_gpt_oss_tok
    segs = t.encode_messages(
        AGENT[:n], add_generation_prompt=True, reasoning_effort="high",
        conversation_start_date="2026-12-01",
    )
    assert "".join(t.decode(s) for s in segs) == tok.decode(list(expect))
    real = tok.encode_messages(
        AGENT[:n], add_generation_prompt=True, reasoning_effort="high",
        conversation_start_date="2026-12-01",
    )
    assert [t.decode(s) for s in segs] == [tok.decode(s) for s in real]
    assert all(i < 256 or i >= 512 - len(HARMONY_SPECIALS) for s in segs for i in s)
    n_special = sum(tok.decode(list(expect)).count(sp) for sp in HARMONY_SPECIALS)
    assert sum(i >= 256 for s in segs for i in s) == n_special


def test_a_message_that_cannot_be_found_is_refused(tok):
    """A template that ends a message one way when it is last and another way when it is
    not, whatever follows, cannot be split into messages: a clear error, not a wrong cut."""
    t = ChatTokenizer(
        tok.tokenizer,
        "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
        "{% if loop.last %}<|return|>{% else %}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant{% endif %}",
        {"eos_token": "<|return|>"},
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(TokenizerError, match="message 0 .'user'. is rendered differently"):
        t.encode_messages(msgs)
