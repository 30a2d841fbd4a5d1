"""GPT-OSS chat: the harmony format through ChatTokenizer's per-message segments.

The vocabulary is o200k_harmony as bundled by ``quicktok-v1`` (read from its data files and
rebuilt as a ``tokenizers`` BPE: :mod:`akv_jax.model.vocabularies`); the chat template is
akv_jax's harmony template (:mod:`akv_jax.model.harmony_template`, the one ``tiny-gpt-oss``
chats with over its byte vocabulary and ``tiny-gpt-oss-bpe`` over o200k_harmony, tested here
too); the oracle for the token ids is ``openai-harmony``, the format's reference renderer, run
offline on the same vocabulary (:func:`akv_jax.model.vocabularies.harmony_encoding`: the
``o200k_base.tiktoken`` file it would download, written from quicktok's ranks, its SHA-256
the published one). Both packages are dev dependencies: without them these tests fail at
import, they are not skipped.
"""

from __future__ import annotations

import json
import random

import openai_harmony
import pytest
import quicktok

from akv_jax.model import vocabularies
from akv_jax.model.harmony_template import HARMONY_SPECIALS, HARMONY_TEMPLATE
from akv_jax.model.tokenizer import ChatTokenizer, TokenizerError
from converters.loading import load_model


@pytest.fixture(scope="module")
def o200k_harmony():
    return vocabularies.o200k_harmony()


@pytest.fixture(scope="module")
def tok():
    """GPT-OSS's tokenizer (``tiny-gpt-oss-bpe``'s): o200k_harmony with the harmony template."""
    return ChatTokenizer.o200k_harmony()


@pytest.fixture(scope="module")
def harmony():
    """openai-harmony and its GPT-OSS encoding, loaded offline from the quicktok vocabulary."""
    return openai_harmony, vocabularies.harmony_encoding()


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


def harmony_groups(h, messages, reasoning_effort="medium", date=None, tools=None):
    """The same conversation as openai-harmony messages, one group per OpenAI message (the
    system message and the developer message of instructions and tools in the first group).

    The mapping, as vLLM and the GPT-OSS template do it: the first message, when it is a system
    or developer message, gives the developer instructions, joined by the tools; an assistant
    message becomes its reasoning (analysis), then its text (a commentary preamble when it
    calls tools, else the final answer) and its calls (commentary, to=functions.NAME, JSON
    arguments: a string as given, a mapping as json.dumps writes it); a tool message comes from
    functions.NAME, NAME its own, else its call's by tool_call_id, else by position."""
    effort = {
        "low": h.ReasoningEffort.LOW,
        "medium": h.ReasoningEffort.MEDIUM,
        "high": h.ReasoningEffort.HIGH,
    }[reasoning_effort]
    system = h.SystemContent.new().with_reasoning_effort(effort)
    if date is not None:
        system = system.with_conversation_start_date(date)
    head = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    dev = h.DeveloperContent.new()
    rest = list(messages)
    if rest and rest[0]["role"] in ("system", "developer"):
        dev = dev.with_instructions(rest.pop(0)["content"])
    if tools:
        dev = dev.with_function_tools([
            h.ToolDescription.new(
                t["function"]["name"],
                t["function"].get("description") or "",
                t["function"].get("parameters"),
            )
            for t in tools
        ])
    if dev.instructions is not None or tools:
        head.append(h.Message.from_role_and_content(h.Role.DEVELOPER, dev))
    groups = [[]] if len(rest) < len(messages) else []  # the first message made the head
    calls, k = [], 0
    for m in rest:
        group = []
        if m["role"] in ("system", "developer"):
            group.append(
                h.Message.from_role_and_content(
                    h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(m["content"])
                )
            )
        elif m["role"] == "user":
            group.append(h.Message.from_role_and_content(h.Role.USER, m["content"]))
        elif m["role"] == "assistant":
            thinking = m.get("thinking") or m.get("reasoning_content")
            if thinking:
                msg = h.Message.from_role_and_content(h.Role.ASSISTANT, thinking)
                group.append(msg.with_channel("analysis"))
            if m.get("tool_calls"):
                calls, k = m["tool_calls"], 0
                if m["content"]:
                    msg = h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"])
                    group.append(msg.with_channel("commentary"))
            for call in m.get("tool_calls") or []:
                f = call["function"]
                args = f["arguments"]
                msg = h.Message.from_role_and_content(
                    h.Role.ASSISTANT, args if isinstance(args, str) else json.dumps(args)
                )
                group.append(
                    msg.with_channel("commentary")
                    .with_recipient(f"functions.{f['name']}")
                    .with_content_type("<|constrain|>json")
                )
            if m["content"] and not m.get("tool_calls"):
                msg = h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"])
                group.append(msg.with_channel("final"))
        elif m["role"] == "tool":
            by_id = [c for c in calls if "tool_call_id" in m and c.get("id") == m["tool_call_id"]]
            name = m.get("name") or (by_id or [calls[min(k, len(calls) - 1)]])[0]["function"][
                "name"
            ]
            k += 1
            group.append(
                h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, f"functions.{name}"),
                                                  m["content"])
                .with_channel("commentary")
                .with_recipient("assistant")
            )
        groups.append(group)
    groups[0] = head + groups[0]
    return groups


def to_harmony(h, messages, reasoning_effort="medium", date=None, tools=None):
    """The same conversation as an openai-harmony Conversation (see :func:`harmony_groups`)."""
    groups = harmony_groups(h, messages, reasoning_effort, date, tools)
    return h.Conversation.from_messages([m for g in groups for m in g])


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


# --------------------------------------------------------------------------- tools


def call(name, args, call_id=None):
    out = {"type": "function", "function": {"name": name, "arguments": args}}
    return out if call_id is None else {"id": call_id, **out}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.\nMetric units.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "kelvin"], "default": "celsius"},
                    "days": {"type": "integer", "default": 1},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time.",
            "parameters": {"type": "object", "properties": {"tz": {"type": ["string", "null"]}}},
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]

# An agent conversation with tools: reasoning, a preamble and two calls (arguments as a JSON
# string and as a mapping), their results answered out of order (names by tool_call_id), a
# final answer, a second question, a call with no id and its result (name by position), and a
# result naming its tool.
TOOL_AGENT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Two tools.",
        "tool_calls": [
            call("get_weather", '{"city":"Paris"}', "c1"),
            call("get_time", {"tz": "Europe/Paris"}, "c2"),
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "10:00"},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "21 °C at 10:00.", "reasoning_content": "Done."},
    {"role": "user", "content": "Ping?"},
    {"role": "assistant", "content": None, "tool_calls": [call("ping", "{}")]},
    {"role": "tool", "content": "pong"},
    {"role": "tool", "name": "get_time", "content": "10:01"},
]


def harmony_segments(h, enc, groups, has_tools):
    """openai-harmony's rendering of each group (render_conversation_for_completion's
    analysis drop applied: while the last assistant message is a final answer, the analysis
    before the first final answer goes), the generation prompt as a last segment."""
    options = h.RenderOptions(conversation_has_function_tools=has_tools)
    flat = [(i, m) for i, g in enumerate(groups) for m in g]
    assistant = [m for _, m in flat if m.author.role == h.Role.ASSISTANT]
    drop = bool(assistant) and assistant[-1].channel == "final"
    first_final = next((j for j, (_, m) in enumerate(flat) if m.channel == "final"), len(flat))
    segments = [[] for _ in groups]
    for j, (i, m) in enumerate(flat):
        if not (drop and j < first_final and m.channel == "analysis"):
            segments[i] += enc.render(m, options)
    return [*segments, enc.encode("<|start|>assistant", allowed_special="all")]


@pytest.mark.parametrize("n", [2, 3, 5, 6, 7, 8, 9, len(TOOL_AGENT)])
def test_tool_conversation_segments_are_openai_harmony_messages(tok, harmony, n):
    """With tools declared, every prefix of the tool conversation: each segment is exactly
    openai-harmony's rendering of that message's harmony messages (the first segment also the
    system and developer messages), and they concatenate to render_conversation_for_completion."""
    h, enc = harmony
    groups = harmony_groups(h, TOOL_AGENT[:n], "high", "2026-12-01", TOOLS)
    expect = harmony_segments(h, enc, groups, has_tools=True)
    conv = h.Conversation.from_messages([m for g in groups for m in g])
    assert [t for s in expect for t in s] == list(
        enc.render_conversation_for_completion(conv, h.Role.ASSISTANT)
    )
    segs = tok.encode_messages(
        TOOL_AGENT[:n], add_generation_prompt=True, tools=TOOLS, reasoning_effort="high",
        conversation_start_date="2026-12-01",
    )
    assert segs == expect


def test_tool_sections_render_as_openai_harmony(tok, harmony):
    """The tools section, with and without instructions: the text openai-harmony writes."""
    h, enc = harmony
    for msgs in ([{"role": "user", "content": "hi"}], TOOL_AGENT[:2]):
        expect = enc.render_conversation_for_completion(
            to_harmony(h, msgs, tools=TOOLS), h.Role.ASSISTANT
        )
        assert tok.apply_chat_template(msgs, True, tools=TOOLS) == list(expect)
    dev = tok.render(TOOL_AGENT[:2], tools=TOOLS).split("<|start|>developer<|message|>")[1]
    assert dev.startswith(
        "# Instructions\n\nAnswer briefly.\n\n# Tools\n\n## functions\n\nnamespace functions {"
        "\n\n// Current weather in a city.\n// Metric units.\ntype get_weather = (_: {\n"
        "// City name\ncity: string,\n"
    )


def test_tool_messages_need_a_name(tok):
    """A tool result with no name and no call before it has no sender: refused."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]
    with pytest.raises(TokenizerError, match="no name and no tool call"):
        tok.render(msgs)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema drawing on every construct harmony's TypeScript conversion reads."""
    words = ["a", "b c", 'q"uote', "ünï", "x_1"]
    s: dict = {}
    kind = rng.choice(
        ["string", "enum", "number", "integer", "boolean", "array", "list", "null", "untyped"]
        + (["object"] * 4 + ["oneOf"] * 2 if depth < 3 else [])
    )
    if kind == "enum":
        s = {"type": "string", "enum": rng.sample(words, rng.randint(1, 3))}
    elif kind == "array":
        s = {"type": "array"}
        if rng.random() < 0.7:
            s["items"] = random_schema(rng, depth + 1)
    elif kind == "list":
        s = {"type": rng.sample(["string", "integer", "null", "boolean"], rng.randint(1, 3))}
    elif kind == "untyped":
        s = {}
    elif kind == "object":
        props = {f"p{i}": random_schema(rng, depth + 1) for i in range(rng.randint(0, 4))}
        s = {"type": "object", "properties": props}
        if props and rng.random() < 0.7:
            s["required"] = rng.sample(sorted(props), rng.randint(1, len(props)))
    elif kind == "oneOf":
        s = {"oneOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
        if rng.random() < 0.4:
            s["description"] = "same"
            s["oneOf"][0]["description"] = rng.choice(["same", "other"])
    else:
        s = {"type": kind}
    if rng.random() < 0.3:
        s["description"] = rng.choice(words)
    if rng.random() < 0.2:
        s["title"] = rng.choice(words)
    if rng.random() < 0.2:
        s["examples"] = [rng.choice(words), 3, rng.choice(words)]
    if rng.random() < 0.2:
        s["nullable"] = rng.choice([True, False])
    if rng.random() < 0.3:
        s["default"] = rng.choice([rng.choice(words), 2, 2.5, True, None, [1, "x"], {"k": [1]}])
    return s


@pytest.mark.parametrize("seed", range(8))
def test_random_tool_schemas_render_as_openai_harmony(tok, harmony, seed):
    """Random parameter schemas (nested objects, enums, type lists, oneOf at the top and in
    properties, titles, examples, defaults of every JSON type, nullable): ids equal."""
    h, enc = harmony
    rng = random.Random(seed)
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"f{i}",
                "description": rng.choice(["", "one line", "two\nlines\n"]),
                "parameters": random_schema(rng),
            },
        }
        for i in range(4)
    ]
    msgs = [{"role": "user", "content": "go"}]
    expect = enc.render_conversation_for_completion(
        to_harmony(h, msgs, tools=tools), h.Role.ASSISTANT
    )
    assert tok.apply_chat_template(msgs, True, tools=tools) == list(expect)


def test_tiny_gpt_oss_bpe_is_tiny_gpt_oss_over_o200k_harmony(o200k_harmony):
    """``tiny-gpt-oss-bpe``: the tiny GPT-OSS with the released vocabulary's 201,088 ids, its
    EOS ids as GPT-OSS's generation_config.json, o200k_harmony's tokenization (quicktok's ids)
    and the harmony template."""
    m = load_model("tiny-gpt-oss-bpe")
    small = load_model("tiny-gpt-oss").cfg
    assert m.cfg.arch == "gpt_oss" and m.cfg.vocab_size == 201088
    assert m.cfg.layer_types == small.layer_types and m.cfg.hidden_size == small.hidden_size
    assert m.params.embed.shape == (201088, small.hidden_size)
    t = m.tokenizer
    assert t.vocab_size == 201088 and t.chat_template == HARMONY_TEMPLATE
    assert set(m.stop_ids) == {200002, 200012, 199999} == set(t.eos_ids)
    text = "<|start|>user<|message|>Zürich — 東京? x=1<|end|><|start|>assistant"
    assert t.encode(text) == list(
        quicktok.get_encoding("o200k_harmony").encode(text, allowed_special="all")
    )
    assert t.token_to_id("<|return|>") == o200k_harmony[1]["<|return|>"]
