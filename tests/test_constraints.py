"""Constrained decoding (akv_jax.formats.constraint): random logits sampled greedily under the
grammar's mask, the output checked by independent tools: jsonschema for documents and call
arguments, openai-harmony for harmony-format output, the families' plain formats parsed here.

Vocabularies: the tiny byte vocabularies of the random test models (512 ids, markers such as
``<think>`` spelled in bytes) and the real o200k_harmony and Qwen3 vocabularies (markers are
single special tokens).
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
from openai_harmony import Role

from akv_jax.formats.constraint import GrammarCompiler, GrammarError, TokenConstraint
from akv_jax.model import vocabularies
from akv_jax.model.byte_bpe import bytes_to_unicode
from akv_jax.model.tokenizer import ChatTokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["celsius", "fahrenheit"]},
        "where": {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number"},
            },
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["city", "days", "where"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 20},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        "exact": {"type": "boolean"},
        "filters": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "field": {"enum": ["title", "body"]},
                    "value": {"type": "string", "maxLength": 10},
                },
                "required": ["field", "value"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
}
REPORT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 20},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "ok": {"type": "boolean"},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 10},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                    "kind": {"enum": ["a", "b", "c"]},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
        },
        "meta": {
            "type": "object",
            "properties": {
                "source": {"type": "string", "maxLength": 10},
                "nested": {
                    "type": "object",
                    "properties": {"depth": {"type": "integer", "maximum": 99}},
                    "required": ["depth"],
                    "additionalProperties": False,
                },
            },
            "required": ["nested"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "items", "meta"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "x", "parameters": SEARCH}},
    {"type": "function", "function": {"name": "noop"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
           for t in TOOLS}
SEEDS = (0, 1, 2)
MAX_STEPS = 2000


# --------------------------------------------------------------------------- vocabularies


class Served:
    """A tokenizer as the engine serves it: the compiler per family, a logits width past the
    tokenizer's vocabulary, and a bias that favours closing tokens (quotes, brackets,
    specials) so that random logits give outputs of a few dozen tokens."""

    def __init__(self, name: str, tok: ChatTokenizer, width: int):
        self.name, self.tok, self.width = name, tok, width
        self.n = tok.vocab_size
        added = {i: t.content for i, t in tok.tokenizer.get_added_tokens_decoder().items()}
        self.added = added
        self.bias = np.zeros(width, np.float32)
        for s, i in tok.tokenizer.get_vocab(with_added_tokens=False).items():
            if any(ch in s for ch in '"}],'):
                self.bias[i] = 1.5
        for i in added:
            self.bias[i] = 2.5
        self.inverse = {c: b for b, c in bytes_to_unicode().items()}

    @functools.cache  # noqa: B019 - one per vocabulary and family, kept for the session
    def compiler(self, family: str) -> GrammarCompiler:
        return GrammarCompiler(self.tok, self.width, family)

    def token_bytes(self, i: int) -> bytes:
        if i in self.added:
            return self.added[i].encode()
        return bytes(self.inverse[c] for c in self.tok.tokenizer.id_to_token(i))

    def text(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode(errors="replace")

    def reserved_ids(self) -> list[int]:
        vocab = self.tok.tokenizer.get_vocab(with_added_tokens=True)
        return sorted(i for s, i in vocab.items() if s.startswith("<|reserved"))


@functools.cache
def served(name: str) -> Served:
    if name == "tiny_harmony":
        return Served(name, ChatTokenizer.byte_level_harmony(512), 520)
    if name == "tiny_chatml":
        return Served(name, ChatTokenizer.byte_level_chatml(512), 520)
    if name == "tiny_minimax":
        return Served(name, ChatTokenizer.byte_level_minimax_m2(512), 520)
    if name == "o200k":
        tok = vocabularies.o200k_harmony_tokenizer()
        extra = [tok.token_to_id("<|call|>"), tok.token_to_id("<|endoftext|>")]
        chat = ChatTokenizer(tok, None, {"eos_token": "<|return|>"}, extra_eos_ids=extra)
        return Served(name, chat, chat.vocab_size + 40)
    if name == "qwen3":
        chat = ChatTokenizer(vocabularies.qwen3_tokenizer(), None, {"eos_token": "<|im_end|>"})
        return Served(name, chat, 151936)  # Qwen3's vocab_size: 267 ids past the tokenizer
    raise KeyError(name)


# (family, vocabulary) pairs served
CASES = [
    ("harmony", "tiny_harmony"),
    ("harmony", "o200k"),
    ("qwen3", "tiny_chatml"),
    ("qwen3", "qwen3"),
    ("plain", "tiny_chatml"),
    ("plain", "qwen3"),
    ("llama3", "tiny_chatml"),
    ("minimax_m2", "tiny_minimax"),
]
REASONING = {"harmony", "qwen3", "minimax_m2"}


# --------------------------------------------------------------------------- driving


class Run:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask_s: list[float] = []
        self.ever_allowed: np.ndarray | None = None


def generate(c: TokenConstraint, s: Served, seed: int, bias: np.ndarray | None = None,
             prefix: list[int] = ()) -> Run:
    """Greedy sampling of seeded random logits under the mask, forced tokens taken as they
    come; every step checks the masked row against allowed()."""
    rng = np.random.default_rng(seed)
    run = Run()
    for t in prefix:
        c.advance(t)
        run.ids.append(t)
    bias = s.bias if bias is None else bias
    for _ in range(MAX_STEPS):
        if c.finished:
            break
        forced = c.forced()
        if forced:
            for t in forced:
                assert c.allowed()[t], "a forced token the mask does not allow"
                c.advance(t)
            run.ids += forced
            continue
        logits = rng.standard_normal(s.width, dtype=np.float32) + bias
        t0 = time.perf_counter()
        masked = c.mask_logits(logits)
        run.mask_s.append(time.perf_counter() - t0)
        allowed = c.allowed()
        assert masked.dtype == logits.dtype and allowed.shape == (s.width,)
        assert np.all(masked[~allowed] == -np.inf)
        assert np.array_equal(masked[allowed], logits[allowed])
        run.ever_allowed = allowed.copy() if run.ever_allowed is None else (
            run.ever_allowed | allowed)
        t = int(np.argmax(masked))
        c.advance(t)
        run.ids.append(t)
    assert c.finished, f"not finished after {MAX_STEPS} steps: {s.text(run.ids)[-200:]!r}"
    return run


# --------------------------------------------------------------------------- parsing


class Parsed:
    def __init__(self, reasoning: str | None, calls: list[tuple[str, dict]] | None = None,
                 document: object = None):
        self.reasoning, self.calls, self.document = reasoning, calls or [], document


def parse(family: str, s: Served, ids: list[int]) -> Parsed:
    if family == "harmony":
        return parse_harmony(s, ids)
    text = s.text(ids)
    eos = s.tok.eos_token
    if family in ("qwen3", "plain"):
        end = "<|im_end|>"
        assert text.endswith(end)
        body, reasoning = text[: -len(end)], None
        m = re.match(r"<think>\n(.*?)\n</think>\n\n", body, re.DOTALL)
        if m:
            assert family == "qwen3"
            reasoning, body = m.group(1), body[m.end():]
        if not body.startswith("<tool_call>"):
            return Parsed(reasoning, document=json.loads(body))
        blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", body, re.DOTALL)
        assert "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks) == body
        calls = [json.loads(b) for b in blocks]
        assert all(list(c) == ["name", "arguments"] for c in calls)
        return Parsed(reasoning, [(c["name"], c["arguments"]) for c in calls])
    if family == "llama3":
        assert text.endswith(eos)
        doc = json.loads(text[: -len(eos)])
        if list(doc) == ["name", "parameters"]:
            return Parsed(None, [(doc["name"], doc["parameters"])], document=doc)
        return Parsed(None, document=doc)
    if family == "minimax_m2":
        assert text.endswith(eos)
        reasoning, _, body = text[: -len(eos)].partition("</think>\n\n")
        if reasoning:  # the template renders it back as "<think>\n{reasoning}\n</think>"
            assert reasoning.endswith("\n")
            reasoning = reasoning[:-1]
        if body.startswith("\n<minimax:tool_call>\n"):  # the newline the template renders
            body = body[1:]
        if not body.startswith("<minimax:tool_call>\n"):
            return Parsed(reasoning, document=json.loads(body))
        m = re.fullmatch(r"<minimax:tool_call>\n(.*)</minimax:tool_call>", body, re.DOTALL)
        assert m
        calls = []
        for name, inner in re.findall(r'<invoke name="([^"]*)">\n(.*?)</invoke>\n', m.group(1),
                                      re.DOTALL):
            props = SCHEMAS[name].get("properties", {})
            args = {}
            for key, value in re.findall(r'<parameter name="([^"]*)">(.*?)</parameter>\n',
                                         inner, re.DOTALL):
                args[key] = value if string_typed(props.get(key, {})) else json.loads(value)
            calls.append((name, args))
        return Parsed(reasoning, calls)
    raise KeyError(family)


def string_typed(prop: dict) -> bool:
    """MiniMax-M2 writes these parameters as raw text: declared strings (by type or by an
    enum of strings) and parameters of no declared type."""
    if "type" in prop:
        return prop["type"] == "string"
    if "enum" in prop:
        return all(isinstance(v, str) for v in prop["enum"])
    return True


def parse_harmony(s: Served, ids: list[int]) -> Parsed:
    """openai-harmony's parse, on o200k ids (the byte vocabulary's text re-encoded)."""
    if s.name != "o200k":
        o200k = vocabularies.o200k_harmony_tokenizer()
        ids = o200k.encode(s.text(ids), add_special_tokens=False).ids
    msgs = vocabularies.harmony_encoding().parse_messages_from_completion_tokens(
        ids, Role.ASSISTANT
    )
    reasoning = None
    if len(msgs) == 2:
        assert msgs[0].channel == "analysis" and msgs[0].recipient is None
        reasoning = msgs[0].content[0].text
    assert len(msgs) in (1, 2)
    last = msgs[-1]
    text = last.content[0].text
    if last.recipient is None:
        assert last.channel == "final"
        return Parsed(reasoning, document=json.loads(text))
    assert last.channel == "commentary" and last.recipient.startswith("functions.")
    assert last.content_type == "<|constrain|>json"
    return Parsed(reasoning, [(last.recipient.removeprefix("functions."), json.loads(text))])


def reasoning_tokens(family: str, s: Served, ids: list[int]) -> int | None:
    """How many tokens hold reasoning text: those overlapping the bytes between the opening
    and the closing marker (None when there is no reasoning block)."""
    data = b"".join(s.token_bytes(i) for i in ids)
    opening, closing = {
        "harmony": (b"<|channel|>analysis<|message|>", b"<|end|>"),
        "qwen3": (b"<think>\n", b"\n</think>"),
        "minimax_m2": (b"", b"\n</think>"),
    }[family]
    if not data.startswith(opening) or (family == "harmony" and b"analysis" not in data):
        return None
    start = len(opening)
    end = data.index(closing, start)
    count, off = 0, 0
    for i in ids:
        n = len(s.token_bytes(i))
        if off < end and off + n > start:
            count += 1
        off += n
    return count


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("family,vocab", CASES)
def test_documents_validate_against_the_schema(family, vocab):
    s = served(vocab)
    gc = s.compiler(family)
    for seed in SEEDS:
        budget = 6 * seed if family in REASONING else 0
        run = generate(gc.json_document(REPORT, reasoning_budget=budget), s, seed)
        p = parse(family, s, run.ids)
        jsonschema.validate(p.document, REPORT)
        if p.reasoning:
            assert budget > 0
    # json_object: any JSON object
    run = generate(gc.json_document(None), s, 7)
    assert isinstance(parse(family, s, run.ids).document, dict)


@pytest.mark.parametrize("family,vocab", CASES)
def test_tool_calls_are_declared_functions_with_valid_arguments(family, vocab):
    s = served(vocab)
    gc = s.compiler(family)
    choices = [["get_weather"], ["search"], ["get_weather", "search"], None]
    seen = set()
    for seed, names in enumerate(choices):
        budget = 4 if family in REASONING and seed % 2 else 0
        c = gc.tool_calls(TOOLS, names=names, reasoning_budget=budget)
        p = parse(family, s, generate(c, s, seed).ids)
        assert len(p.calls) == 1
        for name, args in p.calls:
            assert name in (names or SCHEMAS)
            jsonschema.validate(args, SCHEMAS[name])
            seen.add(name)
    assert {"get_weather", "search"} <= seen


@pytest.mark.parametrize("family,vocab", [c for c in CASES if c[0] in ("qwen3", "minimax_m2")])
def test_parallel_calls(family, vocab):
    s = served(vocab)
    gc = s.compiler(family)
    for seed in SEEDS:
        c = gc.tool_calls(TOOLS, names=["search", "get_weather"], parallel=True)
        p = parse(family, s, generate(c, s, seed).ids)
        assert p.calls
        for name, args in p.calls:
            jsonschema.validate(args, SCHEMAS[name])
    # two calls written out are accepted, and make the grammar finish
    if family == "qwen3":
        call = '<tool_call>\n{"name": "noop", "arguments": {"k": [1, "x"]}}\n</tool_call>'
        text = f"{call}\n{call}<|im_end|>"
    else:
        call = '<invoke name="noop">\n<parameter name="k">[1, 2]</parameter>\n</invoke>\n'
        text = f"\n</think>\n\n\n<minimax:tool_call>\n{call}{call}</minimax:tool_call>[e~["
    c = gc.tool_calls(TOOLS, names=["noop"], parallel=True)
    ids = s.tok.encode(text)
    for t in ids:
        c.advance(t)
    assert c.finished and [n for n, _ in parse(family, s, ids).calls] == ["noop", "noop"]


@pytest.mark.parametrize("family,vocab", [c for c in CASES if c[0] in REASONING])
def test_reasoning_budget_is_honoured(family, vocab):
    s = served(vocab)
    gc = s.compiler(family)
    # No bias toward special tokens (a reasoning block's end): the reasoning runs until the
    # budget cuts it. The block is opened as the model would (minimax_m2's prompt opened it).
    flat = s.bias.copy()
    flat[list(s.added)] = 0
    opening = {"harmony": "<|channel|>analysis<|message|>", "qwen3": "<think>\n"}
    prefix = s.tok.encode(opening[family]) if family in opening else []
    cut = 0
    for budget, seed in ((1, 0), (5, 1), (17, 2)):
        c = gc.json_document(REPORT, reasoning_budget=budget)
        run = generate(c, s, seed, bias=flat, prefix=prefix)
        n = reasoning_tokens(family, s, run.ids)
        assert n is not None and n <= budget, (budget, n, s.text(run.ids)[:200])
        cut += n == budget
        jsonschema.validate(parse(family, s, run.ids).document, REPORT)
    assert cut >= 2  # random text rarely closes by itself: the budget closed it
    # budget 0: no reasoning at all
    run = generate(gc.json_document(REPORT), s, 3, bias=flat)
    p = parse(family, s, run.ids)
    assert p.reasoning in (None, "")
    assert reasoning_tokens(family, s, run.ids) in (None, 0)


@pytest.mark.parametrize("family,vocab", [c for c in CASES if c[0] in REASONING])
def test_reasoning_closed_by_the_model(family, vocab):
    s = served(vocab)
    opening, closing = {
        "harmony": ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant"),
        "qwen3": ("<think>\n", "\n</think>\n\n"),
        "minimax_m2": ("", "\n</think>\n\n"),
    }[family]
    prefix = s.tok.encode(f"{opening}Let me think.\nOk.{closing}")
    c = s.compiler(family).tool_calls(TOOLS, names=["get_weather"], reasoning_budget=64)
    p = parse(family, s, generate(c, s, 0, prefix=prefix).ids)
    assert p.reasoning == "Let me think.\nOk."
    assert p.calls[0][0] == "get_weather"
    jsonschema.validate(p.calls[0][1], WEATHER)


@pytest.mark.parametrize("family,vocab,fixed", [
    ("plain", "qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'),
    ("plain", "tiny_chatml", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'),
    ("harmony", "o200k", " to=functions.get_weather<|channel|>commentary <|constrain|>json"
                         '<|message|>{"city": "'),
    ("llama3", "tiny_chatml", '{"name": "get_weather", "parameters": {"city": "'),
    ("minimax_m2", "tiny_minimax", '\n</think>\n\n\n<minimax:tool_call>\n'
                                   '<invoke name="get_weather">\n<parameter name="city">'),
])
def test_forced_tokens(family, vocab, fixed):
    """With one function named and no reasoning, everything up to the first argument's value
    is fixed by the grammar: forced() hands it out (llguidance may hold back the last token
    or two, where a longer token could span past the fixed text)."""
    s = served(vocab)
    c = s.compiler(family).tool_calls(TOOLS, names=["get_weather"])
    ids: list[int] = []
    while (f := c.forced()) and not c.finished:
        assert c.forced() == f  # not consumed by asking
        for t in f:
            c.advance(t)
        ids += f
    text = s.text(ids)
    assert fixed.startswith(text) and len(text) >= len(fixed) - 4, text
    # forced tokens are the tokenizer's own tokens for that text
    assert ids == s.tok.encode(text)
    # a key opening: after the city's value and the separator, the next required key is fixed
    c = s.compiler(family).json_document(WEATHER)
    opening = {"harmony": "<|channel|>final<|message|>", "minimax_m2": "\n</think>\n\n"}
    feed_text(c, s, opening.get(family, "") + '{"city": "x",')
    after = s.text(c.forced())
    assert len(after) >= 5 and ' "days": '.startswith(after), after


def feed_text(c: TokenConstraint, s: Served, text: str) -> None:
    """Advance through ``text``, taking the forced tokens where the grammar forces them (in
    a forced stretch llguidance's mask allows only its own tokenization of it)."""
    done = ""
    while done != text:
        forced = c.forced()
        if forced and text.startswith(done + s.text(forced)):
            ids = forced
        else:
            ids = s.tok.encode(text[len(done):])[:1]
        for t in ids:
            assert c.allowed()[t], (done, t)
            c.advance(t)
        done += s.text(ids)


def test_never_allowed_ids():
    """Reserved vocabulary entries and ids past the tokenizer are never allowed, in free
    reasoning text or in JSON strings."""
    for family, vocab in (("harmony", "o200k"), ("qwen3", "qwen3"), ("harmony", "tiny_harmony"),
                          ("qwen3", "tiny_chatml"), ("minimax_m2", "tiny_minimax")):
        s = served(vocab)
        run = generate(s.compiler(family).json_document(REPORT, reasoning_budget=40), s, 5)
        ever = run.ever_allowed
        assert not ever[s.n:].any()
        reserved = s.reserved_ids()
        assert (len(reserved) > 100) == (vocab != "qwen3")
        assert not ever[reserved].any()
        assert ever[: s.n].sum() > 1000 if s.n > 1000 else ever[:256].sum() > 100
        c = s.compiler(family).json_document(None)
        with pytest.raises(ValueError):
            c.advance(s.width - 1)
        with pytest.raises(ValueError):
            c.advance(s.width)


def test_mask_logits_and_allowed():
    s = served("tiny_chatml")
    c = s.compiler("plain").json_document(SEARCH)
    allowed = c.allowed()
    assert allowed.dtype == np.bool_ and allowed.shape == (520,)
    assert allowed.sum() == 1 and allowed[ord("{")]  # a document opens with "{"
    for dtype in (np.float32, np.float16, np.float64):
        row = np.arange(520).astype(dtype)
        masked = c.mask_logits(row)
        assert masked.dtype == dtype and masked[ord("{")] == ord("{")
        assert np.isneginf(masked[~allowed]).all()
        assert row[0] == 0  # a copy
    bits = c.bitmask()
    unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little")[:520].astype(bool)
    assert np.array_equal(unpacked, allowed)
    with pytest.raises(ValueError):
        c.mask_logits(np.zeros(519, np.float32))
    with pytest.raises(ValueError):
        c.mask_logits(np.zeros(520, np.int32))


def test_advance_rejects_disallowed_tokens_and_keeps_going():
    s = served("qwen3")
    c = s.compiler("qwen3").tool_calls(TOOLS, names=["search"])
    bad = s.tok.token_to_id("<|im_start|>")
    with pytest.raises(ValueError):
        c.advance(bad)
    with pytest.raises(ValueError):
        c.advance(s.tok.encode("hello")[0])
    p = parse("qwen3", s, generate(c, s, 0).ids)  # the rejections left no trace
    assert p.calls[0][0] == "search"
    with pytest.raises(ValueError):
        c.advance(s.tok.token_to_id("<|im_end|>"))
    assert c.finished and c.forced() == []


def test_check_schema_errors_are_one_line():
    gc = served("tiny_chatml").compiler("plain")
    gc.check_schema(REPORT)
    bad = [
        {"type": "nonsense"},  # the meta-schema refuses it
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}},
        {"type": "string", "format": "no-such-format"},  # llguidance refuses it
        {"$ref": "#/$defs/missing"},
    ]
    for schema in bad:
        with pytest.raises(GrammarError) as e:
            gc.check_schema(schema)
        msg = str(e.value)
        assert msg and "\n" not in msg, msg
    with pytest.raises(GrammarError, match="nonsense"):
        gc.json_document({"type": "nonsense"})
    with pytest.raises(GrammarError):
        gc.tool_calls([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "nonsense"}}}])
    with pytest.raises(GrammarError, match="nope"):
        gc.tool_calls(TOOLS, names=["nope"])
    with pytest.raises(GrammarError):
        gc.tool_calls([])
    with pytest.raises(ValueError):
        gc.json_document(None, reasoning_budget=-1)
    with pytest.raises(ValueError):
        GrammarCompiler(served("tiny_chatml").tok, 100, "plain")
    with pytest.raises(ValueError):
        GrammarCompiler(served("tiny_chatml").tok, 520, "nope")


def test_minimax_raw_string_values_read_back():
    """String-typed parameters are raw text: bounded, enum-restricted, never padded with
    whitespace or one of the words the parser reads as null."""
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
            "level": {"enum": ["low", "high"]},
            "note": {"type": "string", "minLength": 2, "maxLength": 6},
            "n": {"type": "integer"},
        },
        "required": ["code", "mode", "level", "note"],
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    s = served("tiny_minimax")
    SCHEMAS["f"] = schema
    try:
        for seed in range(4):
            ids = generate(s.compiler("minimax_m2").tool_calls(tools), s, seed).ids
            (name, args), = parse("minimax_m2", s, ids).calls
            jsonschema.validate(args, schema)
            assert args["note"] == args["note"].strip()
            assert args["note"].lower() not in ("null", "none", "nil")
    finally:
        del SCHEMAS["f"]


def test_compilers_are_thread_safe():
    s = served("tiny_chatml")
    gc = GrammarCompiler(s.tok, s.width, "qwen3")
    out: list[object] = []

    def work(i: int) -> None:
        try:
            c = gc.tool_calls(TOOLS, names=[["get_weather"], ["search"]][i % 2],
                              reasoning_budget=i % 3)
            out.append(parse("qwen3", s, generate(c, s, i).ids).calls[0][0])
        except Exception as e:  # noqa: BLE001 - reported below
            out.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == ["get_weather"] * 4 + ["search"] * 4


@pytest.mark.parametrize("vocab,family", [("o200k", "harmony"), ("qwen3", "qwen3")])
def test_mask_time_per_token(vocab, family, capsys):
    """Measured, not asserted: host time per token to compute the mask and apply it."""
    s = served(vocab)
    gc = s.compiler(family)
    times = []
    for seed in SEEDS:
        times += generate(gc.json_document(REPORT, reasoning_budget=24), s, seed).mask_s
        times += generate(gc.tool_calls(TOOLS, reasoning_budget=8), s, seed).mask_s
    ms = np.array(times) * 1e3
    with capsys.disabled():
        print(f"\n[mask time] {vocab} ({s.width} ids, {family}): {len(ms)} sampled tokens, "
              f"mean {ms.mean():.3f} ms, median {np.median(ms):.3f} ms, "
              f"p99 {np.percentile(ms, 99):.3f} ms per token")


@pytest.mark.parametrize("vocab", ["tiny_chatml", "qwen3"])
def test_reasoning_opened_by_the_prompt(vocab):
    """A generation prompt that opens ``<think>`` (Qwen3-Thinking-2507's): the reply starts
    inside the block, closes it within the budget, then calls."""
    s = served(vocab)
    gc = s.compiler("qwen3")
    for seed, budget in ((0, 0), (1, 3), (2, 9)):
        c = gc.tool_calls(TOOLS, names=["get_weather"], reasoning_budget=budget,
                          reasoning_open=True)
        text = s.text(generate(c, s, seed).ids)
        reasoning, sep, rest = text.partition("\n</think>\n\n")
        assert sep and "<think>" not in reasoning, text[:200]
        assert len(s.tok.encode(reasoning)) <= budget + 1  # a cut may split a character
        p = parse("qwen3", s, s.tok.encode(rest))
        assert p.calls[0][0] == "get_weather"
        jsonschema.validate(p.calls[0][1], WEATHER)


def test_tool_use_reads_the_generation_prompt():
    from akv_jax.serving.tool_use import ToolUse

    tok = ChatTokenizer.qwen3()
    use = ToolUse(tok, "qwen3_moe", 151936)
    msgs = [{"role": "user", "content": "hi"}]
    thinking = tok.encode_messages(msgs, add_generation_prompt=True)[-1]
    closed = tok.encode_messages(msgs, add_generation_prompt=True, enable_thinking=False)[-1]
    assert tok.decode(closed).endswith("<think>\n\n</think>\n\n")
    assert not use.opens_reasoning(thinking) and not use.opens_reasoning(closed)
    assert use.opens_reasoning(tok.encode("<|im_start|>assistant\n<think>\n"))
    minimax = ToolUse(ChatTokenizer.byte_level_minimax_m2(512), "minimax_m2", 520)
    assert minimax.opens_reasoning([])
