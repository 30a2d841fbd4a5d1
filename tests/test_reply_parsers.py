"""Reply parsers (akv_jax.formats): generated tokens -> content, reasoning, tool calls.

Oracles: harmony replies are rendered by openai-harmony's own renderer from Message objects,
and the parse must give back those messages' reasoning, content and calls; Qwen3 / MiniMax-M2
/ Llama 3 replies are rendered here from known parts (reasoning, content, calls as Python
values) in each format, and the parse must give back the parts. Every parse is also checked
against its own stream (the deltas concatenated, rebuilt here without the library's log), and
the text families against every way of splitting their text into chunks. Qwen3 and MiniMax-M2
parses are also compared with vLLM's own parsers' (tests/fixtures/parser_golden.json, written
by tests/make_parser_golden.py in the vLLM venv).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from openai_harmony import Message, Role

from akv_jax.formats import minimax_m2_reply, qwen3_reply
from akv_jax.formats.llama3_reply import llama3_text
from akv_jax.formats.minimax_m2_reply import convert_value, minimax_m2_text, schema_types
from akv_jax.formats.qwen3_reply import qwen3_text
from akv_jax.formats.reply import (
    FAMILIES,
    Reply,
    ReplyDelta,
    ReplyParser,
    ToolCall,
    family_for,
    prompt_opens_reasoning,
    reply_parser,
)
from akv_jax.formats.text_scan import TextCore, TokenText, partial_suffix_len
from akv_jax.model.tokenizer import ChatTokenizer
from akv_jax.model.vocabularies import (
    harmony_encoding,
    o200k_harmony,
    o200k_harmony_tokenizer,
    qwen3_tokenizer,
)

# --------------------------------------------------------------------------- helpers


def counter_ids():
    """A deterministic call-id factory (one per parse)."""
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def concat(deltas: list[ReplyDelta]) -> Reply:
    """The stream's sum, rebuilt independently of ReplyLog: ids and names once per call,
    arguments concatenated, calls in index order."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert c["id"] is None, "a call's id was sent twice"
                c["id"] = tc.id
            if tc.name is not None:
                assert c["name"] is None, "a call's name was sent twice"
                c["name"] = tc.name
            c["arguments"] += tc.arguments
    assert sorted(calls) == list(range(len(calls))), "call indices are not 0..n-1"
    return Reply(
        "".join(d.content for d in deltas),
        "".join(d.reasoning for d in deltas),
        [ToolCall(**calls[i]) for i in sorted(calls)],
    )


def run_tokens(parser: ReplyParser, ids: list[int]) -> tuple[Reply, list[ReplyDelta]]:
    deltas = [parser.push(t) for t in ids]
    deltas.append(parser.finish())
    reply = parser.reply()
    assert concat(deltas) == reply  # invariant 1
    return reply, deltas


def run_text(core: TextCore, chunks: list[str]) -> Reply:
    deltas = [core.feed(c) for c in chunks]
    deltas.append(core.close())
    return concat(deltas)


def parts(reply: Reply) -> tuple[str, str, list[tuple[str, object]]]:
    """(reasoning, content, [(name, parsed arguments)]), checking every call's arguments
    is a JSON object string (invariant 4)."""
    calls = []
    for c in reply.tool_calls:
        args = json.loads(c.arguments)
        assert isinstance(args, dict)
        calls.append((c.name, args))
    return reply.reasoning, reply.content, calls


def random_splits(text: str, rng: random.Random, n: int) -> list[list[str]]:
    out = []
    for _ in range(n):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    out.append(list(text))  # one character at a time
    return out


def assert_split_invariant(make_core, text: str, seed: int = 0) -> Reply:
    """Invariant 2: the parse of ``text`` does not depend on how it is cut into chunks."""
    whole = run_text(make_core(), [text])
    for i in range(len(text) + 1):
        assert run_text(make_core(), [text[:i], text[i:]]) == whole, f"split at {i}"
    for chunks in random_splits(text, random.Random(seed), 6):
        assert run_text(make_core(), chunks) == whole, chunks
    return whole


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def enc():
    return harmony_encoding()


@pytest.fixture(scope="module")
def o200k_chat():
    """GPT-OSS's real vocabulary (ids equal openai-harmony's), EOS as GPT-OSS's."""
    tok = o200k_harmony_tokenizer()
    return ChatTokenizer(
        tok, None, {"eos_token": "<|return|>"},
        extra_eos_ids=[tok.token_to_id("<|call|>"), tok.token_to_id("<|endoftext|>")],
    )


@pytest.fixture(scope="module")
def tiny_harmony():
    return ChatTokenizer.byte_level_harmony(512)


@pytest.fixture(scope="module")
def qwen3_chat():
    return ChatTokenizer(qwen3_tokenizer(), None, {"eos_token": "<|im_end|>"})


@pytest.fixture(scope="module")
def tiny_chatml():
    return ChatTokenizer.byte_level_chatml(512)


@pytest.fixture(scope="module")
def tiny_minimax():
    return ChatTokenizer.byte_level_minimax_m2(512)


# --------------------------------------------------------------------------- factory


def test_family_for_and_factory(tiny_chatml):
    assert [family_for(a) for a in ("gpt_oss", "qwen3", "qwen3_moe", "minimax_m2", "llama")] == [
        "harmony", "qwen3", "qwen3", "minimax_m2", "llama3",
    ]
    assert family_for("smollm") == family_for("mistral") == "plain"
    for fam in FAMILIES:
        if fam != "harmony":
            assert isinstance(reply_parser(fam, tiny_chatml, tools=True), ReplyParser)
    with pytest.raises(ValueError, match="unknown reply family"):
        reply_parser("nope", tiny_chatml, tools=True)


def test_prompt_opens_reasoning_on_the_project_templates(tiny_chatml, tiny_minimax):
    from akv_jax.model.released_templates import QWEN3_TEMPLATE

    qwen = ChatTokenizer(tiny_chatml.tokenizer, QWEN3_TEMPLATE, {"eos_token": "<|im_end|>"})
    msgs = [{"role": "user", "content": "hi"}]
    assert prompt_opens_reasoning(tiny_minimax.render(msgs, add_generation_prompt=True))
    assert not prompt_opens_reasoning(qwen.render(msgs, add_generation_prompt=True))
    assert not prompt_opens_reasoning(
        qwen.render(msgs, add_generation_prompt=True, enable_thinking=False))
    assert not prompt_opens_reasoning(tiny_chatml.render(msgs, add_generation_prompt=True))
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")


def test_default_call_ids_are_openai_shaped(tiny_chatml):
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = set()
    for _ in range(3):
        reply, _ = run_tokens(reply_parser("qwen3", tiny_chatml, tools=True),
                              tiny_chatml.encode(text))
        (call,) = reply.tool_calls
        assert call.id.startswith("call_") and len(call.id) == 5 + 24 and call.id[5:].isalnum()
        ids.add(call.id)
    assert len(ids) == 3


# --------------------------------------------------------------------------- harmony


def asst(content: str, channel: str, recipient: str | None = None) -> Message:
    m = Message.from_role_and_content(Role.ASSISTANT, content).with_channel(channel)
    if recipient is not None:
        m = m.with_recipient(recipient).with_content_type("<|constrain|>json")
    return m


HARMONY_CASES = [
    [asst("The user greets. Reply briefly.", "analysis"), asst("Hello! How can I help?", "final")],
    [
        asst("Need the weather; call the tool.", "analysis"),
        asst('{"city": "Paris", "unit": "°C"}', "commentary", "functions.get_weather"),
    ],
    [
        asst("Two lookups.", "analysis"),
        asst("Checking both cities.", "commentary"),  # a preamble: content
        asst('{"city": "Zürich"}', "commentary", "functions.get_weather"),
        asst('{"q": "日本 weather", "n": [1, 2]}', "commentary", "functions.search"),
    ],
    [asst("Short answer, no reasoning needed… 😀", "final")],
    [asst("first thought", "analysis"), asst("second thought", "analysis"), asst("ok", "final")],
]


def harmony_generation(enc, messages: list[Message]) -> list[int]:
    """The ids a model generates after the prompt's ``<|start|>assistant``: the messages as
    openai-harmony renders them, the first without that prefix, a final answer ending in
    ``<|return|>`` (the EOS) instead of ``<|end|>``."""
    ids = [t for m in messages for t in enc.render(m)]
    prefix = enc.encode("<|start|>assistant", allowed_special="all")
    assert ids[: len(prefix)] == prefix
    ids = ids[len(prefix) :]
    _, specials = o200k_harmony()
    if messages[-1].channel == "final":
        assert ids[-1] == specials["<|end|>"]
        ids[-1] = specials["<|return|>"]
    return ids


def harmony_expected(messages: list[Message]):
    reasoning = content = ""
    calls = []
    for m in messages:
        text = "".join(c.text for c in m.content)
        if m.recipient and m.recipient.startswith("functions."):
            calls.append((m.recipient.removeprefix("functions."), json.loads(text)))
        elif m.channel == "analysis":
            reasoning += text
        else:
            content += text
    return reasoning, content, calls


@pytest.mark.parametrize("case", range(len(HARMONY_CASES)))
def test_harmony_matches_openai_harmony_rendering(case, enc, o200k_chat, tiny_harmony):
    messages = HARMONY_CASES[case]
    ids = harmony_generation(enc, messages)
    want = harmony_expected(messages)
    # the real vocabulary, ids as they are
    reply, deltas = run_tokens(reply_parser("harmony", o200k_chat, tools=True), ids)
    assert parts(reply) == want
    assert all("<|" not in d.content + d.reasoning for d in deltas)
    # the tiny byte vocabulary: the same text, byte by byte, mapped onto o200k
    text = enc.decode(ids)
    tiny_ids = tiny_harmony.encode(text)
    assert tiny_harmony.decode(tiny_ids) == text and max(tiny_ids) >= 256
    reply, deltas = run_tokens(reply_parser("harmony", tiny_harmony, tools=False), tiny_ids)
    assert parts(reply) == want
    # call arguments stream: more than one piece per call on the byte vocabulary
    for i, _ in enumerate(want[2]):
        assert sum(1 for d in deltas for tc in d.tool_calls if tc.index == i and tc.arguments) > 1


def test_harmony_recipient_after_channel(enc, o200k_chat, tiny_harmony):
    """``<|channel|>commentary to=functions.NAME`` (the recipient after the channel)."""
    args = {"path": "/tmp/x", "mode": "r"}
    text = (
        "<|channel|>analysis<|message|>Read it.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json"
        f"<|message|>{json.dumps(args)}<|call|>"
    )
    for tok in (o200k_chat, tiny_harmony):
        reply, _ = run_tokens(reply_parser("harmony", tok, tools=True), tok.encode(text))
        assert parts(reply) == ("Read it.", "", [("read_file", args)])


def test_harmony_endings_and_cuts(enc, o200k_chat, tiny_harmony):
    for tok in (o200k_chat, tiny_harmony):
        eot = tok.token_to_id("<|endoftext|>")
        # <|endoftext|> (an EOS that ends no message) after <|return|> is ignored
        ids = tok.encode("<|channel|>final<|message|>Done.<|return|>") + [eot]
        reply, _ = run_tokens(reply_parser("harmony", tok, tools=True), ids)
        assert parts(reply) == ("", "Done.", [])
        # a length cut inside the next header: the partial header is markup, not content
        ids = tok.encode("<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|chan")
        reply, _ = run_tokens(reply_parser("harmony", tok, tools=True), ids)
        assert parts(reply) == ("Hmm", "", [])
        # a length cut inside a message: what was generated so far
        ids = tok.encode("<|channel|>final<|message|>Half an ans")
        reply, _ = run_tokens(reply_parser("harmony", tok, tools=True), ids)
        assert parts(reply) == ("", "Half an ans", [])


def test_harmony_garbage_is_content(o200k_chat, tiny_harmony):
    """Tokens the harmony parser refuses or never makes a message of come back as their
    text, as content (a random model's output), never as an error."""
    for tok in (o200k_chat, tiny_harmony):
        text = "Plain text with no header at all."
        reply, _ = run_tokens(reply_parser("harmony", tok, tools=True), tok.encode(text))
        assert reply == Reply(text, "", [])
        # a message, then tokens harmony refuses (after <|end|> only <|start|> may come)
        good = tok.encode("<|channel|>analysis<|message|>ok<|end|>")
        bad = tok.encode(" stray words 😀")[:-1]  # ending inside a character
        reply, _ = run_tokens(reply_parser("harmony", tok, tools=True), good + bad)
        assert reply == Reply(tok.decode(bad), "ok", [])
    rng = random.Random(7)
    for tok, n in ((tiny_harmony, 512), (o200k_chat, 200_000)):
        for _ in range(20):
            ids = [rng.randrange(n) for _ in range(rng.randint(1, 80))]
            run_tokens(reply_parser("harmony", tok, tools=True), ids)  # must not raise


# --------------------------------------------------------------------------- qwen3


def hermes_text(reasoning: str | None, content: str, calls: list[tuple[str, dict]]) -> str:
    """A Qwen3 reply in its format (as Qwen3's chat template renders an assistant turn)."""
    out = f"<think>\n{reasoning}\n</think>\n\n" if reasoning is not None else ""
    out += content
    for name, args in calls:
        call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        out += f"\n<tool_call>\n{call}\n</tool_call>"
    return out


QWEN3_CASES = [
    ("The user says hi.", "Hello there!", []),
    ("Weather needed.", "", [("get_weather", {"city": "Paris"})]),
    ("Two calls.\nThen answer.", "Let me check.",
     [("get_weather", {"city": "Zürich", "days": 3}),
      ("search", {"q": "日本", "tags": ["a", "b"]})]),
    (None, "No reasoning here, just content with < and > and {braces}.", []),
    ("", "Empty reasoning block.", [("noop", {})]),
]


@pytest.mark.parametrize("case", range(len(QWEN3_CASES)))
def test_qwen3_on_real_and_byte_ids(case, qwen3_chat, tiny_chatml):
    reasoning, content, calls = QWEN3_CASES[case]
    text = hermes_text(reasoning, content, calls)
    want = ((reasoning or "").strip(), content.strip(), calls)
    for tok in (qwen3_chat, tiny_chatml):
        ids = tok.encode(text) + [tok.token_to_id("<|im_end|>")]
        if tok is qwen3_chat and reasoning is not None:
            assert tok.token_to_id("<think>") in ids  # the special-token path is exercised
        reply, deltas = run_tokens(reply_parser("qwen3", tok, tools=True), ids)
        assert parts(reply) == want
        # arguments exactly as vLLM's hermes parser writes them
        assert [c.arguments for c in reply.tool_calls] == [
            json.dumps(a, ensure_ascii=False) for _, a in calls
        ]
        for d in deltas:
            assert "<tool_call>" not in d.content and "<think>" not in d.reasoning


def test_qwen3_without_tools_keeps_markup_as_content(qwen3_chat, tiny_chatml):
    reasoning, content, calls = QWEN3_CASES[2]
    text = hermes_text(reasoning, content, calls)
    after_think = text.split("</think>", 1)[1].strip()
    for tok in (qwen3_chat, tiny_chatml):
        reply, _ = run_tokens(reply_parser("qwen3", tok, tools=False), tok.encode(text))
        assert reply == Reply(after_think, reasoning.strip(), [])


def test_qwen3_reasoning_rules():
    def parse(text, **kw):
        return parts(assert_split_invariant(
            lambda: qwen3_text(tools=True, call_id=counter_ids(), **kw), text))

    # cut off inside <think>: all reasoning (vLLM's Qwen3ReasoningParser)
    assert parse("<think>\nstill thinking about it") == ("still thinking about it", "", [])
    # reasoning never leaks into content, even a call written inside it
    t = hermes_text("secret plan <tool_call>{}</tool_call>", "answer", [])
    assert parse(t) == ("secret plan <tool_call>{}</tool_call>", "answer", [])
    # the prompt opened the block (reasoning_open): text up to </think> is reasoning
    assert parse("planning\n</think>\n\nAnswer.", reasoning_open=True) == (
        "planning", "Answer.", [])
    # no <think>: content, and a later </think> is just text
    assert parse("Hi </think> there") == ("", "Hi </think> there", [])


def test_qwen3_bad_calls_stay_content():
    call = json.dumps({"name": "f", "arguments": {"a": 1}})
    cases = {
        # JSON that does not parse, truncated JSON, an object that is not a call
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>": None,
        "<tool_call>\n{\"name\": \"f\", \"argu": None,
        "<tool_call>\n{\"arguments\": {}}\n</tool_call>": None,
        "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>": None,
        "<tool_call>\n{\"name\": \"f\", \"arguments\": NaN}\n</tool_call>": None,
        # an unclosed block whose JSON is whole (vLLM's hermes regex takes it)
        f"<tool_call>\n{call}\n": [("f", {"a": 1})],
        # arguments given as a JSON string, and no arguments at all
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>': [("f", {"a": 1})],
        '<tool_call>{"name": "f"}</tool_call>': [("f", {})],
    }
    for text, calls in cases.items():
        reply = assert_split_invariant(lambda: qwen3_text(tools=True, call_id=counter_ids()),
                                       "Before. " + text)
        if calls is None:
            assert parts(reply) == ("", ("Before. " + text).strip(), [])
        else:
            assert parts(reply) == ("", "Before.", calls)


def test_held_back_markup_is_never_streamed():
    core = qwen3_text(tools=True, call_id=counter_ids())
    assert core.feed("<thi") == ReplyDelta()
    assert core.feed("nk>\nWhy") == ReplyDelta(reasoning="Why")
    assert core.feed("?</thi") == ReplyDelta(reasoning="?")
    assert core.feed("nk>\n\nBecause. <tool_ca") == ReplyDelta(content="Because.")
    d = core.feed('ll>{"name": "f", "arguments": {}}</tool_call> ok')
    assert d.content == "  ok" and [t.name for t in d.tool_calls] == ["f"]
    assert core.feed(" <tool") == ReplyDelta()
    assert core.close() == ReplyDelta(content=" <tool")
    assert partial_suffix_len("abc<tool_ca", ["<tool_call>"]) == len("<tool_ca")
    assert partial_suffix_len("abc<tool_call>", ["<tool_call>"]) == 0


# --------------------------------------------------------------------------- minimax_m2


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "ratio": {"type": "number"},
        "metric": {"type": "boolean"},
        "opts": {"type": "object"},
        "tags": {"anyOf": [{"type": "array"}, {"type": "null"}]},
        "level": {"enum": [1, 2, 3]},
    },
}


def param_text(value) -> str:
    """How MiniMax-M2 writes a parameter value: strings raw, others as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def minimax_text(reasoning: str, content: str, blocks: list[list[tuple[str, dict]]]) -> str:
    """A MiniMax-M2 reply after the generation prompt's ``<think>\\n``."""
    out = f"{reasoning}\n</think>\n\n{content}"
    for invokes in blocks:
        out += "\n<minimax:tool_call>\n"
        for name, params in invokes:
            out += f'<invoke name="{name}">\n'
            for k, v in params.items():
                out += f'<parameter name="{k}">{param_text(v)}</parameter>\n'
            out += "</invoke>\n"
        out += "</minimax:tool_call>"
    return out


MINIMAX_CASES = [
    ("Simple question.", "The answer is 4.", []),
    ("Need weather.", "", [[("get_weather", {"city": "Paris", "days": 3})]]),
    ("Several.", "Checking.", [
        [("get_weather", {"city": "São Paulo", "days": 2, "ratio": 0.5, "metric": True,
                          "opts": {"a": [1, 2]}, "tags": ["x"], "level": 2}),
         ("get_weather", {"city": "Oslo"})],
        [("search", {"q": "multi\nline\nquery"})],
    ]),
]


@pytest.mark.parametrize("case", range(len(MINIMAX_CASES)))
def test_minimax_m2_typed_by_schema(case, tiny_minimax):
    reasoning, content, blocks = MINIMAX_CASES[case]
    text = minimax_text(reasoning, content, blocks)
    calls = [c for block in blocks for c in block]
    schemas = {"get_weather": WEATHER_SCHEMA, "search": {}}  # search: no parameters declared
    ids = tiny_minimax.encode(text) + list(tiny_minimax.eos_ids)
    parser = reply_parser("minimax_m2", tiny_minimax, tools=True, tool_schemas=schemas)
    reply, _ = run_tokens(parser, ids)
    # declared parameters come back as the values written; undeclared ones as their text
    want_calls = [
        (n, {k: v if n == "get_weather" else param_text(v) for k, v in p.items()})
        for n, p in calls
    ]
    assert parts(reply) == (reasoning, content, want_calls)
    # without schemas every value is its text
    reply, _ = run_tokens(reply_parser("minimax_m2", tiny_minimax, tools=True), ids)
    assert parts(reply) == (
        reasoning, content, [(n, {k: param_text(v) for k, v in p.items()}) for n, p in calls]
    )
    # without tools the call markup is content
    reply, _ = run_tokens(reply_parser("minimax_m2", tiny_minimax, tools=False), ids)
    assert parts(reply) == (reasoning, text.split("</think>", 1)[1].strip(), [])


def test_minimax_m2_rules():
    def parse(text, **kw):
        return parts(assert_split_invariant(
            lambda: minimax_m2_text(tools=True, call_id=counter_ids(), **kw), text))

    block = '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1</parameter>\n'
    whole = block + "</invoke>\n</minimax:tool_call>"
    # an invoke of a tool not declared is no call (vLLM's validate_tool_names)
    assert parse("r</think>" + whole, tool_schemas={"g": {}}) == ("r", whole, [])
    assert parse("r</think>" + whole, tool_schemas={"f": {}}) == ("r", "", [("f", {"a": "1"})])
    # a block the reply ends inside is content (vLLM parses closed blocks only)
    assert parse("r</think>x " + block) == ("r", "x " + block.strip(), [])
    # a block without invokes is content
    empty = "<minimax:tool_call>\nnothing\n</minimax:tool_call>"
    assert parse("r</think>" + empty) == ("r", empty, [])
    # a block start ends reasoning (vLLM's parser engine); single-quoted names
    t = "thinking<minimax:tool_call><invoke name='f'><parameter name='a'>x</parameter></invoke>"
    assert parse(t + "</minimax:tool_call>") == ("thinking", "", [("f", {"a": "x"})])
    # truncated reasoning is reasoning; a <think> the model writes again is dropped
    assert parse("<think>\nhalf a tho") == ("half a tho", "", [])
    # reasoning_open=False: no <think>, no reasoning
    assert parse("Just text.", reasoning_open=False) == ("", "Just text.", [])


def test_minimax_m2_value_conversion():
    """vLLM's coerce_to_schema_type rules (the first declared type, in the order null,
    integer, number, boolean, object, array, string, that the text reads as)."""
    for value, types, want in [
        ("42", {"integer"}, 42),
        (" 42 ", {"int"}, 42),  # a type alias; int() takes the spaces
        ("4.0", {"number"}, 4),
        ("2.5", {"double"}, 2.5),
        ("true", {"boolean"}, True),
        ("0", {"boolean"}, False),
        ("yes", {"boolean"}, "yes"),  # not a boolean to vLLM: JSON, else the text
        ("null", {"string"}, "null"),
        ("null", {"string", "null"}, None),
        ("x", {"integer", "string"}, "x"),
        ("7", {"integer", "string"}, 7),
        ('{"a": [1]}', {"object"}, {"a": [1]}),
        ("[1, 2]", {"string"}, "[1, 2]"),
        ("[1, 2]", {"boolean"}, [1, 2]),  # no type fits: JSON
        ("1e400", {"number"}, "1e400"),  # inf is not JSON: the text
        ("[1e400]", {"array"}, "[1e400]"),
    ]:
        got = convert_value(value, types)
        assert got == want and type(got) is type(want), (value, types, got)
    # a number too large for JSON (inf) is kept as its text, so arguments stay JSON
    block = '<invoke name="f"><parameter name="x">1e400</parameter></invoke>'
    schema = {"f": {"properties": {"x": {"type": "number"}}}}
    assert minimax_m2_reply.parse_invokes(block, schema) == [("f", '{"x": "1e400"}')]
    assert schema_types({"anyOf": [{"type": "integer"}, {"enum": ["a", None]}]}) == {
        "integer", "string", "null"}
    assert schema_types(None) == {"string"}


# --------------------------------------------------------------------------- vLLM golden

GOLDEN = Path(__file__).parent / "fixtures" / "parser_golden.json"


@pytest.mark.skipif(not GOLDEN.exists(), reason="run tests/make_parser_golden.py (vLLM venv)")
def test_matches_vllm_golden_parses():
    """Texts parsed by vLLM's own Qwen3 (hermes + qwen3) and MiniMax-M2 parsers
    (tests/make_parser_golden.py). Reasoning and content agree up to their surrounding
    whitespace (akv_jax strips it); the deviations each case records must still differ,
    and everything else must agree."""
    golden = json.loads(GOLDEN.read_text())
    assert golden["cases"]
    for case in golden["cases"]:
        if case["family"] == "qwen3":  # vLLM's default enable_thinking: the block is open
            core = qwen3_text(tools=True, call_id=counter_ids(), reasoning_open=True)
        else:
            core = minimax_m2_text(tools=True, call_id=counter_ids(),
                                   tool_schemas=golden["tools"])
        ours = run_text(core, [case["text"]])
        parts(ours)
        got = {
            "reasoning": ours.reasoning,
            "content": ours.content,
            "tool_calls": [(c.name, c.arguments) for c in ours.tool_calls],
        }
        want = {
            "reasoning": (case["reasoning"] or "").strip(),
            "content": (case["content"] or "").strip(),
            "tool_calls": [(c["name"], c["arguments"]) for c in case["tool_calls"]],
        }
        for field in got:
            if field in case["deviations"]:
                assert got[field] != want[field], (field, case["text"])
            else:
                assert got[field] == want[field], (field, case["text"])


# --------------------------------------------------------------------------- llama3


def test_llama3_json_calls(tiny_chatml):
    def make():
        return llama3_text(tools=True, call_id=counter_ids())

    one = {"name": "get_weather", "parameters": {"city": "Paris"}}
    two = {"name": "search", "arguments": {"q": "日本"}}
    cases = [
        (json.dumps(one), [("get_weather", {"city": "Paris"})]),
        (f"<|python_tag|>{json.dumps(one)}; {json.dumps(two)}",
         [("get_weather", {"city": "Paris"}), ("search", {"q": "日本"})]),
        ("  " + json.dumps(two, indent=2) + "\n", [("search", {"q": "日本"})]),
    ]
    for text, calls in cases:
        assert parts(assert_split_invariant(make, text)) == ("", "", calls)
        ids = tiny_chatml.encode(text)
        reply, _ = run_tokens(reply_parser("llama3", tiny_chatml, tools=True), ids)
        assert parts(reply) == ("", "", calls)
        # without tools: the text as it is
        reply, _ = run_tokens(reply_parser("llama3", tiny_chatml, tools=False), ids)
        assert reply == Reply(text, "", [])
    for text in [
        "Hello {name}, nothing to call.",
        '{"foo": 1}',
        json.dumps(one) + " and then some text",
        json.dumps(one) + "; {\"name\": \"g\", \"parameters\": [",
        "<|python_tag|>print('hi')",
        "<|python",
    ]:
        assert parts(assert_split_invariant(make, text)) == ("", text, [])


# --------------------------------------------------------------------------- plain


def test_plain_is_the_decoded_text(tiny_chatml, qwen3_chat):
    rng = random.Random(3)
    text = "Plain reply: naïve café, 日本語, emoji 😀, <think>not special here</think>."
    for tok in (tiny_chatml, qwen3_chat):
        ids = tok.encode(text)
        reply, _ = run_tokens(reply_parser("plain", tok, tools=True), ids)
        assert reply == Reply(tok.decode(ids, skip_special_tokens=True), "", [])
    # random bytes, incomplete characters included: the same as one whole decode
    for _ in range(20):
        ids = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        reply, _ = run_tokens(reply_parser("plain", tiny_chatml, tools=True), ids)
        assert reply.content == tiny_chatml.decode(ids, skip_special_tokens=True)


def test_token_text_keeps_markup_tokens(qwen3_chat):
    """Qwen3's <think> / <tool_call> are single tokens; they decode to their text while
    other special tokens are skipped, and multi-token characters are never split."""
    text = "<think>\nà😀\n</think>\n\nhi<|endoftext|><tool_call>\n{}\n</tool_call>"
    ids = qwen3_chat.encode(text)
    dec = TokenText(qwen3_chat, qwen3_reply.MARKERS)
    pieces = [dec.push(t) for t in ids] + [dec.flush()]
    assert "".join(pieces) == text.replace("<|endoftext|>", "")
    assert all("\ufffd" not in p for p in pieces)


# --------------------------------------------------------------------------- invariants


def split_texts() -> list[tuple[str, object]]:
    """Representative texts for every text family (with its core factory)."""

    def qwen(**kw):
        return lambda: qwen3_text(tools=True, call_id=counter_ids(), **kw)

    def mm(**kw):
        return lambda: minimax_m2_text(
            tools=True, call_id=counter_ids(), tool_schemas={"get_weather": WEATHER_SCHEMA}, **kw
        )

    out = [(hermes_text(*case), qwen()) for case in QWEN3_CASES]
    out += [(hermes_text(*QWEN3_CASES[2]), lambda: qwen3_text(tools=False, call_id=counter_ids()))]
    out += [("Some text <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\":}}\n</tool_call> "
             "and <tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>", qwen())]
    out += [(minimax_text(*case), mm()) for case in MINIMAX_CASES]
    out += [("<think>\nr\n</think> c <minimax:tool_call><invoke name=\"f\"></invoke>", mm())]
    return out


@pytest.mark.parametrize("i", range(len(split_texts())))
def test_every_split_point_gives_the_same_parse(i):
    text, make = split_texts()[i]
    assert_split_invariant(make, text, seed=i)


FUZZ_PIECES = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<minimax:tool_call>",
    "</minimax:tool_call>", '<invoke name="f">', "</invoke>", '<parameter name="a">',
    "</parameter>", "<|python_tag|>", "<", "</", "<tool_", "<think", "{", "}", '"name": "f"',
    '"arguments": {}', ";", ",", ":", "\n", " ", "x", "é", "日", "null", "1",
]


def test_garbage_never_raises_and_streams_consistently(tiny_chatml, tiny_minimax):
    """Invariant 3: random mixtures of markup pieces and text, and random token ids, parse
    without error; the stream always sums to the reply, and the split does not matter."""
    rng = random.Random(11)
    makers = [
        lambda: qwen3_text(tools=True, call_id=counter_ids()),
        lambda: qwen3_text(tools=True, call_id=counter_ids(), reasoning_open=True),
        lambda: minimax_m2_text(tools=True, call_id=counter_ids()),
        lambda: llama3_text(tools=True, call_id=counter_ids()),
    ]
    for _ in range(60):
        text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 40)))
        for make in makers:
            whole = run_text(make(), [text])
            parts(whole)  # any call's arguments is a JSON object
            for chunks in random_splits(text, rng, 2) if len(text) > 1 else []:
                assert run_text(make(), chunks) == whole
    for fam, tok in [("qwen3", tiny_chatml), ("minimax_m2", tiny_minimax),
                     ("llama3", tiny_chatml), ("plain", tiny_chatml)]:
        for tools in (True, False):
            for _ in range(10):
                ids = [rng.randrange(512) for _ in range(rng.randint(0, 80))]
                parts(run_tokens(reply_parser(fam, tok, tools=tools), ids)[0])
