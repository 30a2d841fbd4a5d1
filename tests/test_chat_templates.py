"""The tiny models' chat templates on agent conversations, family by family: tools declared, an
assistant turn with reasoning and a tool call (its arguments a JSON string or a mapping), the
tool's result, a final answer; each message one segment of ChatTokenizer.encode_messages, the
segments concatenating to apply_chat_template.

Oracles:
- harmony (tiny-gpt-oss, tiny-gpt-oss-bpe): openai-harmony's renderer, token ids on
  o200k_harmony (tests/test_harmony.py has the format's details).
- Qwen3 (tiny-qwen3-moe, tiny-qwen3-moe-bpe): they chat with Qwen3's released template itself
  (its digest pinned below), so its renderings are checked against the format as Qwen's
  documentation prints it (QwenLM/Qwen3 docs/source/framework/function_call.md, commit
  f4d356c "add qwen3", the rendered function-calling example, copied below) and, for what
  that example does not show (reasoning), against the template's rules written out by hand.
- MiniMax-M2 (tiny-minimax-m2): ours is the released template with two edits, so both are
  rendered through ChatTokenizer and compared, and the released one against the tool prompt
  MiniMax's documentation prints (MiniMax-AI/MiniMax-M2 docs/tool_calling_guide.md, "Internal
  Processing Format").

Consecutive tool results (parallel calls) are one turn in Qwen3's and MiniMax-M2's formats;
encode_messages cuts that turn into one segment per result.
"""

from __future__ import annotations

import hashlib
import json

import openai_harmony
import pytest

from akv_jax.model import vocabularies
from akv_jax.model.chat_template import MINIMAX_M2_TINY_SPECIALS, MINIMAX_M2_TINY_TEMPLATE
from akv_jax.model.released_templates import MINIMAX_M2_TEMPLATE, QWEN3_TEMPLATE
from akv_jax.model.tokenizer import ChatTokenizer, TokenizerError
from converters.loading import load_model

# SHA-256 of llama.cpp's models/templates/Qwen-Qwen3-0.6B.jinja (commit e121edc43) and
# models/templates/MiniMax-M2.jinja (commit 1920345c3), the files the texts were copied from.
QWEN3_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"
MINIMAX_M2_SHA256 = "967ff7e387676f4b4340585da0585416532f1e6c5ee3f1ede64b2c21ef7ea001"


def test_released_templates_are_the_copied_files():
    assert hashlib.sha256(QWEN3_TEMPLATE.encode()).hexdigest() == QWEN3_SHA256
    assert hashlib.sha256(MINIMAX_M2_TEMPLATE.encode()).hexdigest() == MINIMAX_M2_SHA256


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ARGS = {"city": "Paris", "days": 2}


def agent(args):
    """The conversation every family is tested on; ``args`` the call's arguments."""
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I need the weather.",
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": args}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "Sunny, 21 °C.", "reasoning_content": "It is warm."},
    ]


ARG_FORMS = {"json": json.dumps(ARGS), "dict": ARGS}


def check_segments(tok, msgs, texts, **kwargs):
    """Segments are one per message (and the generation prompt), each decoding to its text in
    ``texts``, and concatenate to apply_chat_template."""
    agp = len(texts) > len(msgs)
    segs = tok.encode_messages(msgs, agp, **kwargs)
    assert [t for s in segs for t in s] == tok.apply_chat_template(msgs, agp, **kwargs)
    assert [tok.decode(s) for s in segs] == texts
    return segs


# --------------------------------------------------------------------------- harmony


@pytest.mark.parametrize("form", ARG_FORMS)
def test_harmony_agent_conversation_is_openai_harmonys(form):
    """The harmony family on the shared conversation: ids equal openai-harmony's rendering,
    through tiny-gpt-oss-bpe's tokenizer and (as text) tiny-gpt-oss's byte tokenizer."""
    h, enc = openai_harmony, vocabularies.harmony_encoding()
    msgs = agent(ARG_FORMS[form])
    tools = h.DeveloperContent.new().with_instructions("Be brief.").with_function_tools(
        [h.ToolDescription.new("get_weather", "Weather of a city.",
                               WEATHER["function"]["parameters"])]
    )
    conv = [
        h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new()),
        h.Message.from_role_and_content(h.Role.DEVELOPER, tools),
        h.Message.from_role_and_content(h.Role.USER, "Weather in Paris?"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "I need the weather.")
        .with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, json.dumps(ARGS))
        .with_channel("commentary").with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        h.Message.from_author_and_content(
            h.Author.new(h.Role.TOOL, "functions.get_weather"), '{"temp": 21}'
        ).with_channel("commentary").with_recipient("assistant"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "It is warm.").with_channel("analysis"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Sunny, 21 °C.").with_channel("final"),
    ]
    bpe, byte = ChatTokenizer.o200k_harmony(), load_model("tiny-gpt-oss").tokenizer
    for n_openai, n_harmony in ((4, 6), (5, 8)):
        expect = list(enc.render_conversation_for_completion(
            h.Conversation.from_messages(conv[:n_harmony]), h.Role.ASSISTANT
        ))
        segs = bpe.encode_messages(msgs[:n_openai], True, tools=[WEATHER])
        assert [t for s in segs for t in s] == expect and len(segs) == n_openai + 1
        segs = byte.encode_messages(msgs[:n_openai], True, tools=[WEATHER])
        assert "".join(byte.decode(s) for s in segs) == enc.decode(expect)


# --------------------------------------------------------------------------- Qwen3

QWEN_DOC_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_current_temperature",
            "description": "Get current temperature at a location.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "string",
                        "description": 'The location to get the temperature for, in the format'
                        ' "City, State, Country".',
                    },
                    "unit": {
                        "type": "string",
                        "enum": ["celsius", "fahrenheit"],
                        "description": 'The unit to return the temperature in. Defaults to'
                        ' "celsius".',
                    },
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_temperature_date",
            "description": "Get temperature at a location and date.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {
                        "type": "string",
                        "description": 'The location to get the temperature for, in the format'
                        ' "City, State, Country".',
                    },
                    "date": {
                        "type": "string",
                        "description": 'The date to get the temperature for, in the format'
                        ' "Year-Month-Day".',
                    },
                    "unit": {
                        "type": "string",
                        "enum": ["celsius", "fahrenheit"],
                        "description": 'The unit to return the temperature in. Defaults to'
                        ' "celsius".',
                    },
                },
                "required": ["location", "date"],
            },
        },
    },
]
SF = "San Francisco, CA, USA"
QWEN_DOC_MESSAGES = [
    {
        "role": "system",
        "content": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n"
        "Current Date: 2024-09-30",
    },
    {"role": "user", "content": "What's the temperature in San Francisco now? How about tomorrow?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {
                "name": "get_current_temperature", "arguments": json.dumps({"location": SF})}},
            {"id": "b", "type": "function", "function": {
                "name": "get_temperature_date",
                "arguments": json.dumps({"location": SF, "date": "2024-10-01"})}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": json.dumps(
        {"temperature": 26.1, "location": SF, "unit": "celsius"})},
    {"role": "tool", "tool_call_id": "b", "content": json.dumps(
        {"temperature": 25.9, "location": SF, "date": "2024-10-01", "unit": "celsius"})},
    {
        "role": "assistant",
        "content": "The current temperature in San Francisco is approximately 26.1°C. Tomorrow, "
        "on October 1, 2024, the temperature is expected to be around 25.9°C.",
    },
]
# The documentation's rendering of that conversation, line by line.
QWEN_DOC_TEXT = "\n".join([
    "<|im_start|>system",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "",
    "Current Date: 2024-09-30",
    "",
    "# Tools",
    "",
    "You may call one or more functions to assist with the user query.",
    "",
    "You are provided with function signatures within <tools></tools> XML tags:",
    "<tools>",
    '{"type": "function", "function": {"name": "get_current_temperature", "description": "Get '
    'current temperature at a location.", "parameters": {"type": "object", "properties": {'
    '"location": {"type": "string", "description": "The location to get the temperature for, in'
    ' the format \\"City, State, Country\\"."}, "unit": {"type": "string", "enum": ["celsius", '
    '"fahrenheit"], "description": "The unit to return the temperature in. Defaults to '
    '\\"celsius\\"."}}, "required": ["location"]}}}',
    '{"type": "function", "function": {"name": "get_temperature_date", "description": "Get '
    'temperature at a location and date.", "parameters": {"type": "object", "properties": {'
    '"location": {"type": "string", "description": "The location to get the temperature for, in'
    ' the format \\"City, State, Country\\"."}, "date": {"type": "string", "description": "The '
    'date to get the temperature for, in the format \\"Year-Month-Day\\"."}, "unit": {"type": '
    '"string", "enum": ["celsius", "fahrenheit"], "description": "The unit to return the '
    'temperature in. Defaults to \\"celsius\\"."}}, "required": ["location", "date"]}}}',
    "</tools>",
    "",
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:",
    "<tool_call>",
    '{"name": <function-name>, "arguments": <args-json-object>}',
    "</tool_call><|im_end|>",
    "<|im_start|>user",
    "What's the temperature in San Francisco now? How about tomorrow?<|im_end|>",
    "<|im_start|>assistant",
    "<tool_call>",
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}',
    "</tool_call>",
    "<tool_call>",
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01"}}',
    "</tool_call><|im_end|>",
    "<|im_start|>user",
    "<tool_response>",
    '{"temperature": 26.1, "location": "San Francisco, CA, USA", "unit": "celsius"}',
    "</tool_response>",
    "<tool_response>",
    '{"temperature": 25.9, "location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": '
    '"celsius"}',
    "</tool_response><|im_end|>",
    "<|im_start|>assistant",
    "The current temperature in San Francisco is approximately 26.1°C. Tomorrow, on October 1, "
    "2024, the temperature is expected to be around 25.9°C.<|im_end|>",
    "",
])


@pytest.fixture(scope="module")
def qwen_toks():
    """tiny-qwen3-moe's tokenizer (bytes) and tiny-qwen3-moe-bpe's (Qwen3's vocabulary)."""
    return load_model("tiny-qwen3-moe").tokenizer, load_model("tiny-qwen3-moe-bpe").tokenizer


def test_qwen3_renders_qwens_documented_function_calling_example(qwen_toks):
    """Qwen's documented rendering of a function-calling conversation: system message with the
    tools, the calls (arguments as the JSON strings clients send, or as mappings), both
    results in one user turn. Up to the generation prompt it is the documentation's text; the
    answer as the last message opens with Qwen3's empty think block (the example predates
    Qwen3's reasoning)."""
    head, answer = QWEN_DOC_TEXT.rsplit("<|im_start|>assistant\n", 1)
    dict_args = json.loads(json.dumps(QWEN_DOC_MESSAGES))
    for call in dict_args[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    for tok in qwen_toks:
        for msgs in (QWEN_DOC_MESSAGES, dict_args):
            assert tok.render(msgs[:-1], True, tools=QWEN_DOC_TOOLS) == (
                head + "<|im_start|>assistant\n"
            )
            assert tok.render(msgs, tools=QWEN_DOC_TOOLS) == (
                head + "<|im_start|>assistant\n<think>\n\n</think>\n\n" + answer
            )


QWEN_SYSTEM = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
    "XML tags:\n<tools>\n" + json.dumps(WEATHER) + "\n</tools>\n\nFor each function call, return "
    "a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
QWEN_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
    "</tool_call><|im_end|>\n"
)
# The agent conversation, each message's text: reasoning is kept for the turns after the last
# user query (the one tool call and the answer here), in <think> blocks.
QWEN_AGENT_TEXTS = [
    QWEN_SYSTEM,
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
    "<|im_start|>assistant\n<think>\nI need the weather.\n</think>\n\n" + QWEN_CALL,
    '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n',
    "<|im_start|>assistant\n<think>\nIt is warm.\n</think>\n\nSunny, 21 °C.<|im_end|>\n",
    "<|im_start|>assistant\n",
]


@pytest.mark.parametrize("form", ARG_FORMS)
def test_qwen3_agent_conversation_segments(qwen_toks, form):
    """The shared conversation in Qwen3's format, one segment per message, with the bytes and
    with Qwen3's vocabulary (its markup, <think> and <tool_call> included, single ids); after a
    new user question the earlier turns lose their reasoning (the template's rule), every
    other message keeping its segment."""
    byte, bpe = qwen_toks
    msgs = agent(ARG_FORMS[form])
    for tok in (byte, bpe):
        for n in range(2, len(msgs) + 1):
            check_segments(tok, msgs[:n], QWEN_AGENT_TEXTS[:n], tools=[WEATHER])
            texts = [*QWEN_AGENT_TEXTS[:n], QWEN_AGENT_TEXTS[-1]]
            check_segments(tok, msgs[:n], texts, tools=[WEATHER])
        later = [*msgs, {"role": "user", "content": "And Rome?"}]
        texts = [
            *QWEN_AGENT_TEXTS[:2],
            "<|im_start|>assistant\n" + QWEN_CALL,
            QWEN_AGENT_TEXTS[3],
            "<|im_start|>assistant\nSunny, 21 °C.<|im_end|>\n",
            "<|im_start|>user\nAnd Rome?<|im_end|>\n",
            QWEN_AGENT_TEXTS[-1],
        ]
        check_segments(tok, later, texts, tools=[WEATHER])
    ids = bpe.encode(QWEN_AGENT_TEXTS[2])
    markup = ["<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>"]
    assert [i for i in ids if i >= 151643] == [bpe.token_to_id(t) for t in markup]


def test_qwen3_parallel_tool_results_are_segments(qwen_toks):
    """The documentation's two calls and two results: each result its own segment, the turn's
    markup split between them."""
    tok = qwen_toks[0]
    segs = tok.encode_messages(QWEN_DOC_MESSAGES, tools=QWEN_DOC_TOOLS)
    assert [t for s in segs for t in s] == tok.apply_chat_template(
        QWEN_DOC_MESSAGES, tools=QWEN_DOC_TOOLS
    )
    assert len(segs) == len(QWEN_DOC_MESSAGES)
    assert tok.decode(segs[3]).startswith("<|im_start|>user\n<tool_response>\n")
    assert tok.decode(segs[4]).endswith("</tool_response><|im_end|>\n")


def test_qwen3_bpe_model():
    """``tiny-qwen3-moe-bpe``: tiny-qwen3-moe's shapes over Qwen3's vocabulary padded to the
    released 151,936 rows, EOS <|im_end|> and <|endoftext|> (generation_config.json), ids
    as quicktok's Qwen3 encoding; markup tokens not special, so a plain decode keeps them."""
    import quicktok

    m, small = load_model("tiny-qwen3-moe-bpe"), load_model("tiny-qwen3-moe").cfg
    assert m.cfg.arch == "qwen3_moe" and m.cfg.vocab_size == 151936
    assert m.cfg.num_experts == small.num_experts and m.cfg.num_layers == small.num_layers
    tok = m.tokenizer
    assert tok.vocab_size == 151669 and tok.chat_template == QWEN3_TEMPLATE
    assert m.stop_ids == (151645, 151643) and tok.eos_ids == (151645, 151643)
    text = "".join(QWEN_AGENT_TEXTS) + "naïve 東京 x=1;\n\n  y"
    assert tok.encode(text) == list(
        quicktok.get_encoding("qwen3").encode(text, allowed_special="all")
    )
    ids = tok.encode("<think>hi</think><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<think>hi</think>"


# --------------------------------------------------------------------------- MiniMax-M2


@pytest.fixture(scope="module")
def minimax():
    """tiny-minimax-m2's tokenizer, and the same vocabulary with the released template."""
    tok = load_model("tiny-minimax-m2").tokenizer
    return tok, ChatTokenizer(tok.tokenizer, MINIMAX_M2_TEMPLATE, tok.special_tokens)


MINIMAX_DOC_TOOL = {
    "type": "function",
    "function": {
        "name": "search_web",
        "description": "Search function.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "Keywords for search, list should contain 1 element.",
                },
                "query_tag": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": "Category of query",
                },
            },
            "required": ["query_list", "query_tag"],
        },
    },
}
# The documentation's example prompt, line by line, but for one line: its example lacks the
# </minimax:tool_call> that closes the call format in the system message, which every copy
# of the released template found (llama.cpp's among them) renders.
MINIMAX_DOC_PROMPT = "\n".join([
    "]~!b[]~b]system",
    "You are a helpful assistant.",
    "",
    "# Tools",
    "You may call one or more tools to assist with the user query.",
    "Here are the tools available in JSONSchema format:",
    "",
    "<tools>",
    '<tool>{"name": "search_web", "description": "Search function.", "parameters": {"type": '
    '"object", "properties": {"query_list": {"type": "array", "items": {"type": "string"}, '
    '"description": "Keywords for search, list should contain 1 element."}, "query_tag": '
    '{"type": "array", "items": {"type": "string"}, "description": "Category of query"}}, '
    '"required": ["query_list", "query_tag"]}}</tool>',
    "</tools>",
    "",
    "When making tool calls, use XML format to invoke tools and pass parameters:",
    "",
    "<minimax:tool_call>",
    '<invoke name="tool-name-1">',
    '<parameter name="param-key-1">param-value-1</parameter>',
    '<parameter name="param-key-2">param-value-2</parameter>',
    "...",
    "</invoke>",
    "</minimax:tool_call>[e~[",
    "]~b]user",
    "When were the latest announcements from OpenAI and Gemini?[e~[",
    "]~b]ai",
    "<think>",
    "",
])


def test_minimax_renders_the_documented_tool_prompt(minimax):
    ours, released = minimax
    msgs = [{"role": "user", "content": "When were the latest announcements from OpenAI and "
                                        "Gemini?"}]
    for tok in (ours, released):
        assert tok.render(msgs, True, tools=[MINIMAX_DOC_TOOL]) == MINIMAX_DOC_PROMPT


MINIMAX_SYSTEM = MINIMAX_DOC_PROMPT.split("[e~[")[0].replace(
    "You are a helpful assistant.", "Be brief."
).replace(
    json.dumps(MINIMAX_DOC_TOOL["function"]), json.dumps(WEATHER["function"])
) + "[e~[\n"
# The agent conversation, each message's text (the documented call format: one <invoke> per
# call, one <parameter> per argument, strings bare and other values as JSON).
MINIMAX_AGENT_TEXTS = [
    MINIMAX_SYSTEM,
    "]~b]user\nWeather in Paris?[e~[\n",
    "]~b]ai\n<think>\nI need the weather.\n</think>\n\n\n<minimax:tool_call>\n"
    '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
    '<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>[e~[\n',
    ']~b]tool\n<response>{"temp": 21}</response>[e~[\n',
    "]~b]ai\n<think>\nIt is warm.\n</think>\n\nSunny, 21 °C.[e~[\n",
    "]~b]ai\n<think>\n",
]


@pytest.mark.parametrize("form", ARG_FORMS)
def test_minimax_agent_conversation_segments(minimax, form):
    """The shared conversation: ours renders it as the released template renders it with the
    arguments as a mapping (the only form the released text takes), one segment per message;
    after a new user message the earlier turns lose their reasoning, as released."""
    ours, released = minimax
    msgs = agent(ARG_FORMS[form])
    as_dict = agent(ARGS)
    later = [{"role": "user", "content": "And Rome?"}]
    for n in range(2, len(msgs) + 1):
        for agp in (True, False):
            assert ours.render(msgs[:n], agp, tools=[WEATHER]) == released.render(
                as_dict[:n], agp, tools=[WEATHER]
            )
        check_segments(ours, msgs[:n], MINIMAX_AGENT_TEXTS[:n], tools=[WEATHER])
        check_segments(ours, msgs[:n], [*MINIMAX_AGENT_TEXTS[:n], MINIMAX_AGENT_TEXTS[-1]],
                       tools=[WEATHER])
    assert ours.render(msgs + later, tools=[WEATHER]) == released.render(
        as_dict + later, tools=[WEATHER]
    )
    texts = [
        *MINIMAX_AGENT_TEXTS[:2],
        MINIMAX_AGENT_TEXTS[2].replace("<think>\nI need the weather.\n</think>\n\n", ""),
        MINIMAX_AGENT_TEXTS[3],
        "]~b]ai\nSunny, 21 °C.[e~[\n",
        "]~b]user\nAnd Rome?[e~[\n",
        MINIMAX_AGENT_TEXTS[-1],
    ]
    check_segments(ours, msgs + later, texts, tools=[WEATHER])


def test_minimax_edits(minimax):
    """What ours does that the released text does not: JSON-string arguments (refused when
    not JSON), and a tool message that answers no call."""
    ours, released = minimax
    msgs = agent(json.dumps(ARGS))
    with pytest.raises(TokenizerError):
        released.render(msgs[:3])
    bad = agent("{city: Paris}")
    with pytest.raises(TokenizerError, match="not JSON"):
        ours.render(bad[:3])
    orphan = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]
    with pytest.raises(TokenizerError, match="no previous assistant message with a tool call"):
        released.render(orphan)
    assert ours.render(orphan).endswith("]~b]tool\n<response>x</response>[e~[\n")
    assert MINIMAX_M2_TINY_TEMPLATE != MINIMAX_M2_TEMPLATE
    assert [ours.token_to_id(t) for t in MINIMAX_M2_TINY_SPECIALS] == [509, 510, 511]


def test_minimax_parallel_tool_results_are_segments(minimax):
    ours, _ = minimax
    msgs = agent(ARGS)
    msgs[2]["tool_calls"].append(
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    )
    msgs.insert(4, {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 25}'})
    segs = ours.encode_messages(msgs, tools=[WEATHER])
    assert [t for s in segs for t in s] == ours.apply_chat_template(msgs, tools=[WEATHER])
    assert len(segs) == len(msgs)
    assert ours.decode(segs[3]).startswith("]~b]tool\n<response>")
    assert ours.decode(segs[4]).endswith("</response>[e~[\n")
