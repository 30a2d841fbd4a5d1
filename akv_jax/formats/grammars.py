"""Per-family grammar text (llguidance's Lark dialect) for constrained decoding.

Each grammar describes what the model writes after the chat template's generation prompt,
ending with the token that ends the generation, so the grammar is complete exactly when
generation must stop. JSON inside it (a document, a call's arguments) is llguidance's own
JSON-schema support, embedded as ``%json {...}``.

Format strings are written once, as text, and :meth:`Vocab.seq` turns the markers that are
single special tokens in the served vocabulary (``<|channel|>``, Qwen3's ``<think>``) into
token references; in a byte vocabulary the same markers stay text. See
``docs/syntax.md`` of llguidance for the dialect.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llguidance import regex_to_lark

from akv_jax.formats.minimax_m2_reply import schema_types

# Tool-call arguments and documents as ``json.dumps`` writes them (the chat templates render
# calls with ``tojson``, so that is the form models are trained on); fixed separators also
# let the grammar force keys and punctuation (jump-forward). A schema's own "x-guidance" wins.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}

NL = "\n"
# Whitespace Python's str.strip() removes (MiniMax's reply parser strips parameter values).
STRIPPED = r"[\s\x1c-\x1f]"
# Closers that end MiniMax's parameter, invoke and block parses: a raw value holds none.
MINIMAX_CLOSERS = ("</parameter>", "</invoke>", "</minimax:tool_call>")


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


class Vocab:
    """What grammar text needs from a tokenizer: its special tokens (by text) and EOS ids."""

    def __init__(self, specials: dict[str, int], eos_ids: Sequence[int]):
        self.specials = dict(specials)
        self.eos_ids = tuple(eos_ids)
        names = sorted(self.specials, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def is_special(self, text: str) -> bool:
        return text in self.specials

    def special(self, text: str) -> str:
        """A reference to the special token spelled ``text`` (KeyError if there is none)."""
        return token_ref([self.specials[text]])

    def seq(self, text: str) -> str:
        """Grammar for the fixed text ``text``: its special tokens as token references, the
        rest as string literals."""
        out = [self.special(p) if sp else literal(p) for p, sp in self.pieces(text)]
        return " ".join(out) if out else '""'

    def pieces(self, text: str) -> list[tuple[str, bool]]:
        """``text`` cut into (piece, is a special token)."""
        parts = self._split.split(text) if self._split else [text]
        return [(p, p in self.specials) for p in parts if p]

    def eos(self) -> str:
        if not self.eos_ids:
            raise ValueError("the tokenizer has no EOS token")
        return token_ref(self.eos_ids)


def literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def token_ref(ids: Sequence[int]) -> str:
    return "<[" + ",".join(str(i) for i in ids) + "]>"


def styled(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` in :data:`JSON_STYLE` unless its own "x-guidance" says otherwise."""
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def json_schema(schema: dict[str, Any]) -> str:
    """``%json`` for ``schema`` (llguidance's JSON-schema support inside Lark)."""
    return "%json " + json.dumps(styled(schema), ensure_ascii=False)


class Rules:
    """Grammar text being built: named rules, in order."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.count = 0

    def add(self, body: str, prefix: str = "r", options: str = "") -> str:
        """A new rule for ``body``; its name. Upper-case prefixes make terminals."""
        self.count += 1
        name = f"{prefix}_{self.count}"
        self.lines.append(f"{name}{options}: {body}")
        return name

    def lexeme(self, body: str, options: str = "") -> str:
        """A rule matching one lexeme, the terminal ``body`` (options such as ``max_tokens``
        apply to rules whose body is one terminal)."""
        return self.add(self.add(body, "T"), "t", options)

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.lines]) + "\n"


def reasoning(rules: Rules, vocab: Vocab, close: str, budget: int) -> str:
    """Free text of at most ``budget`` tokens, then ``close``; the expression for both.

    llguidance ends a ``max_tokens`` lexeme at its limit whether or not it matched, by taking
    the first lexeme still alive, so two lexemes run side by side: ``cut`` (listed first, so
    the limit picks it) is text that never holds ``close`` and is followed by ``close`` in the
    grammar; ``closed`` ends with ``close`` and finishes when the model writes it. A greedy
    text lexeme followed by a text literal could never end (llguidance's lexer does not
    backtrack), so a text ``close`` is only ever matched inside ``closed``.
    """
    pieces = vocab.pieces(close)
    if any(sp for _, sp in pieces[:-1]):
        raise ValueError(f"cannot bound reasoning closed by {close!r}")
    special = pieces[-1][0] if pieces[-1][1] else None
    head = close[: len(close) - len(special)] if special else close
    limit = f"max_tokens={budget}"
    if special is not None:
        # Text cannot run into a special token: the text lexeme is greedy.
        if not head:
            text = rules.lexeme("/(?s:.*)/", f"[{limit}]")
            return f"{text} {vocab.special(special)}"
        cut = rules.lexeme("/(?s:.*)/", f"[{limit}]")
        closed = rules.lexeme(f"/(?s:.*)/ {literal(head)}", f"[{limit}]")
        return f"({cut} {literal(head)} | {closed}) {vocab.special(special)}"
    cut = rules.lexeme(f"/(?s:.*)/ & ~(/(?s:.*)/ {literal(close)} /(?s:.*)/)", f"[{limit}]")
    closed = rules.lexeme(f"/(?s:.*)/ {literal(close)}", f"[lazy, {limit}]")
    return f"({cut} {literal(close)} | {closed})"


def alternatives(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else "(" + " | ".join(items) + ")"


# --------------------------------------------------------------------------- families


def harmony(vocab: Vocab, tools: Sequence[Tool] | None, schema: dict[str, Any] | None,
            budget: int) -> str:
    """GPT-OSS: optional analysis message, then one call (harmony ends a generation at
    ``<|call|>``) or a final message holding the document."""
    rules = Rules()
    head = ""
    if budget > 0:
        text = reasoning(rules, vocab, "<|end|>", budget)
        head = rules.add(
            f"{vocab.seq('<|channel|>analysis<|message|>')} {text} "
            f"{vocab.seq('<|start|>assistant')}"
        ) + "? "
    if tools is None:
        doc = rules.add(json_schema(schema or ANY_OBJECT))
        return rules.text(
            f"{head}{vocab.seq('<|channel|>final<|message|>')} {doc} {vocab.seq('<|return|>')}"
        )
    calls = []
    for tool in tools:
        args = rules.add(json_schema(tool.parameters))
        calls.append(rules.add(
            f"{literal(' to=functions.' + tool.name)} "
            f"{vocab.seq('<|channel|>commentary <|constrain|>json<|message|>')} {args} "
            f"{vocab.seq('<|call|>')}"
        ))
    return rules.text(head + alternatives(calls))


def chatml(vocab: Vocab, tools: Sequence[Tool] | None, schema: dict[str, Any] | None,
           budget: int, parallel: bool, think: bool, reasoning_open: bool = False) -> str:
    """Qwen3 (``think``) and plain: optional ``<think>`` block, then Hermes-style
    ``<tool_call>`` blocks (one, or with ``parallel`` one or more) or the document, then
    ``<|im_end|>`` (the EOS where the vocabulary has no ``<|im_end|>``). With
    ``reasoning_open`` (the prompt opened the block, as Qwen3-Thinking-2507's does) the
    reply starts inside it and must close it."""
    rules = Rules()
    head = ""
    if think and reasoning_open:
        text = (reasoning(rules, vocab, "\n</think>", budget) if budget > 0
                else vocab.seq("\n</think>"))
        head = rules.add(f"{text} {literal(NL * 2)}") + " "
    elif think and budget > 0:
        text = reasoning(rules, vocab, "\n</think>", budget)
        head = rules.add(f"{vocab.seq('<think>')} {literal(NL)} {text} {literal(NL * 2)}")
        head += "? "
    end = vocab.seq("<|im_end|>") if vocab.is_special("<|im_end|>") else vocab.eos()
    if tools is None:
        doc = rules.add(json_schema(schema or ANY_OBJECT))
        return rules.text(f"{head}{doc} {end}")
    fns = json_calls(rules, tools, "arguments")
    call = rules.add(
        f"{vocab.seq('<tool_call>')} {literal(NL)} {alternatives(fns)} "
        f"{literal(NL)} {vocab.seq('</tool_call>')}"
    )
    calls = f'{call} ("\\n" {call})*' if parallel else call
    return rules.text(f"{head}{calls} {end}")


def llama3(vocab: Vocab, tools: Sequence[Tool] | None, schema: dict[str, Any] | None) -> str:
    """Llama 3's JSON tool call ``{"name": ..., "parameters": ...}`` or the document, then EOS."""
    rules = Rules()
    if tools is None:
        return rules.text(f"{rules.add(json_schema(schema or ANY_OBJECT))} {vocab.eos()}")
    return rules.text(f"{alternatives(json_calls(rules, tools, 'parameters'))} {vocab.eos()}")


def json_calls(rules: Rules, tools: Sequence[Tool], arguments: str) -> list[str]:
    """One rule per tool for its JSON call ``{"name": NAME, ARGUMENTS: {...}}`` (the key
    Qwen3's hermes calls name "arguments" and Llama 3's "parameters")."""
    fns = []
    for tool in tools:
        args = rules.add(json_schema(tool.parameters))
        prefix = ('{"name": ' + json.dumps(tool.name, ensure_ascii=False)
                  + f', "{arguments}": ')
        fns.append(rules.add(f'{literal(prefix)} {args} "}}"'))
    return fns


def minimax_m2(vocab: Vocab, tools: Sequence[Tool] | None, schema: dict[str, Any] | None,
               budget: int, parallel: bool) -> str:
    """MiniMax-M2: the reasoning the generation prompt opened, ``\\n</think>\\n\\n`` (as
    the template renders it back), then one ``<minimax:tool_call>`` block (one invoke, or
    with ``parallel`` one or more) after the newline the template puts before a block, or
    the document, then EOS: a reply is written as the template renders it in later turns,
    so the whole of it is found in the cache when it is sent back."""
    rules = Rules()
    head = (reasoning(rules, vocab, "\n</think>", budget) if budget > 0
            else vocab.seq("\n</think>"))
    head = f"{head} {literal(NL * 2)} "
    if tools is None:
        return rules.text(f"{head}{rules.add(json_schema(schema or ANY_OBJECT))} {vocab.eos()}")
    invokes = [minimax_invoke(rules, vocab, tool) for tool in tools]
    invoke = alternatives(invokes)
    body = f"{invoke}+" if parallel else invoke
    return rules.text(
        f"{head}{vocab.seq(NL + '<minimax:tool_call>' + NL)} {body} "
        f"{vocab.seq('</minimax:tool_call>')} {vocab.eos()}"
    )


def minimax_invoke(rules: Rules, vocab: Vocab, tool: Tool) -> str:
    """One ``<invoke>``: the schema's properties in schema order, required ones present."""
    props = tool.parameters.get("properties") or {}
    required = tool.parameters.get("required", [])
    params = [(k, v, k in required) for k, v in props.items()]
    params += [(k, {}, True) for k in required if k not in props]  # required, undeclared
    parts = []
    for key, prop, needed in params:
        head = literal(f'<parameter name="{key}">')
        if schema_types(prop) == {"string"}:
            value = rules.lexeme(raw_string(prop), "[lazy]")
            p = rules.add(f"{head} {value} {literal(NL)}")
        else:
            value = rules.add(json_schema(prop if isinstance(prop, dict) else {}))
            p = rules.add(f"{head} {value} {literal('</parameter>' + NL)}")
        parts.append(p if needed else p + "?")
    if not props and tool.parameters.get("additionalProperties", True) is not False:
        # Any object: any keys, values as raw text (the parser reads JSON where it parses).
        key = rules.add(r'/[^"<>\n]+/', "T")
        value = rules.lexeme(raw_string({}), "[lazy]")
        name = f"{literal('<parameter name=\"')} {key} {literal('\">')}"
        parts.append(rules.add(f"{name} {value} {literal(NL)}") + "*")
    start = literal(f'<invoke name="{tool.name}">\n')
    return rules.add(" ".join([start, *parts, literal("</invoke>\n")]))


def raw_string(prop: dict[str, Any]) -> str:
    """A terminal for a raw string value and its ``</parameter>``, as MiniMax's parser reads
    it back (stripped; ``null``/``none``/``nil`` mean null): no surrounding whitespace, not
    one of those words, no closer inside; ``enum``/``const``, ``minLength``/``maxLength`` and
    ``pattern`` enforced (``format`` is an annotation in JSON Schema, not enforced)."""
    if "const" in prop or "enum" in prop:
        values = [prop["const"]] if "const" in prop else list(prop["enum"])
        body = "(" + " | ".join(literal(v) for v in values if isinstance(v, str)) + ")"
        return f"{body} {literal('</parameter>')}"
    lo, hi = int(prop.get("minLength", 0)), prop.get("maxLength")
    length = f"{{{lo},{'' if hi is None else int(hi)}}}"
    closers = " | ".join(literal(c) for c in MINIMAX_CLOSERS)
    terms = [
        f"/(?s:.{length})/",
        f"~/{STRIPPED}(?s:.*)/",
        f"~/(?s:.*){STRIPPED}/",
        "~/(?i:null|none|nil)/",
        f"~(/(?s:.*)/ ({closers}) /(?s:.*)/)",
    ]
    if "pattern" in prop:
        terms.append(f"/{search_regex(prop['pattern'])}/")
    return "(" + " & ".join(terms) + f") {literal('</parameter>')}"


def search_regex(pattern: str) -> str:
    """A JSON-schema ``pattern`` (found anywhere in the string unless anchored) as a
    whole-match llguidance regex."""
    lead = pattern.startswith("^")
    trail = pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[int(lead): len(pattern) - int(trail)]
    core = regex_to_lark(core, "dw")
    return ("" if lead else "(?s:.*)") + f"(?:{core})" + ("" if trail else "(?s:.*)")
