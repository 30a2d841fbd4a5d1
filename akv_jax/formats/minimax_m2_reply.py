"""MiniMax-M2 replies: the generation prompt opens ``<think>\\n``, so a reply starts as
reasoning up to ``</think>``, then content and call blocks::

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>
    </invoke>
    </minimax:tool_call>

Follows vLLM's current MiniMax-M2 parser (vllm/parser/minimax_m2.py, the parser engine behind
``--tool-call-parser minimax_m2 --reasoning-parser minimax_m2``, checked against vLLM 0.32 by
tests/fixtures/parser_golden.json): each ``<invoke>`` of a closed block is a call, to a declared
tool when ``tool_schemas`` declares them (vLLM's ``validate_tool_names``); parameter values are
kept verbatim and a declared parameter's value is typed by its JSON schema the way vLLM's
``coerce_to_schema_type`` does (tool_parsers/utils.py); arguments are the parameters' JSON
object. A block without (declared) invokes, or one the reply ends inside, stays content (vLLM
parses closed blocks only). A block start inside reasoning ends the reasoning, as in vLLM's
engine. Unlike vLLM, which keeps only the text before the first block, text after a block is
content too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from akv_jax.formats.text_scan import (
    THINK_END,
    THINK_START,
    TaggedText,
    TextReplyParser,
    dumps_strict,
    loads_strict,
)

TOOL_CALL = ("<minimax:tool_call>", "</minimax:tool_call>")
MARKERS = (THINK_START, THINK_END, *TOOL_CALL)

INVOKE = re.compile(r"<invoke name=(.*?)</invoke>", re.DOTALL)
PARAMETER = re.compile(r"<parameter name=(.*?)</parameter>", re.DOTALL)
# JSON Schema type spellings vLLM accepts for the standard names (tool_parsers/utils.py)
TYPE_ALIASES = {
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
    **dict.fromkeys(
        ("int", "int32", "int64", "uint", "uint32", "uint64", "long", "short", "unsigned"),
        "integer",
    ),
    **dict.fromkeys(("float", "float32", "float64", "double"), "number"),
    "bool": "boolean",
    "dict": "object",
    **dict.fromkeys(("arr", "list", "sequence"), "array"),
}
TYPE_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


def unquote(name: str) -> str:
    name = name.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        return name[1:-1]
    return name


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows (``type``, ``enum`` values, and
    ``anyOf`` / ``oneOf`` / ``allOf`` recursively); ``{"string"}`` when none is said."""
    if not isinstance(schema, dict):
        return {"string"}
    types = {t for t in as_list(schema.get("type")) if isinstance(t, str)}
    enum = schema.get("enum")
    types |= {json_type(v) for v in enum} if isinstance(enum, list) else set()
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        for choice in choices if isinstance(choices, list) else ():
            types |= schema_types(choice)
    return types or {"string"}


def as_list(value: Any) -> list[Any]:
    """A schema field that may be a list, one value, or absent, as a list."""
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"


def convert_value(value: str, types: set[str]) -> Any:
    """A declared parameter's text -> its JSON value: the first of its types (in vLLM's
    order null, integer, number, boolean, object, array, string) the text reads as; else
    JSON if it parses to a finite value; else the text. Never a value JSON cannot write."""
    wanted = {TYPE_ALIASES.get(k, k) for k in (t.strip().lower() for t in types)}
    for t in TYPE_PRIORITY:
        if t not in wanted:
            continue
        if t == "string":
            return value
        if t == "null" and value.lower() == "null":
            return None
        if t == "boolean" and value.strip().lower() in ("true", "1", "false", "0"):
            return value.strip().lower() in ("true", "1")
        try:
            if t == "integer":
                return int(value)
            if t == "number":
                f = float(value)
                if math.isfinite(f):
                    return int(f) if f == int(f) else f
            if t in ("object", "array") and is_finite(parsed := loads_strict(value)):
                return parsed
        except (ValueError, RecursionError):
            continue
    try:
        parsed = loads_strict(value)
    except (ValueError, RecursionError):
        return value
    return parsed if is_finite(parsed) else value


def is_finite(value: Any) -> bool:
    """No inf / nan anywhere in a parsed JSON value (``1e999`` parses to inf)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(is_finite(v) for v in value)
    if isinstance(value, dict):
        return all(is_finite(v) for v in value.values())
    return True


def parse_invokes(body: str, tool_schemas: dict[str, Any] | None) -> list[tuple[str, str]] | None:
    """A closed block's body -> [(name, arguments)], or None when it holds no invoke (of a
    declared tool, when ``tool_schemas`` declares them)."""
    calls = []
    for invoke in INVOKE.findall(body):
        head = re.match(r"[^>]+", invoke)
        name = unquote(head.group(0)) if head else ""
        if not name or (tool_schemas is not None and name not in tool_schemas):
            continue
        schema = (tool_schemas or {}).get(name)
        props = schema.get("properties") if isinstance(schema, dict) else None
        props = props if isinstance(props, dict) else {}
        params: dict[str, Any] = {}
        for p in PARAMETER.findall(invoke):
            m = re.match(r"([^>]+)>(.*)", p, re.DOTALL)
            key = unquote(m.group(1)) if m else ""
            if not key:
                continue
            value = m.group(2)  # verbatim: whitespace inside the tags is data
            declared = props.get(key)
            params[key] = convert_value(value, schema_types(declared)) if isinstance(
                declared, dict) else value
        calls.append((name, dumps_strict(params)))
    return calls or None


def minimax_m2_text(
    *,
    tools: bool,
    call_id: Callable[[], str],
    tool_schemas: dict[str, Any] | None = None,
    reasoning_open: bool = True,
) -> TaggedText:
    """The text state machine (fed decoded text; the tests feed it directly)."""
    return TaggedText(
        block=TOOL_CALL, parse_block=lambda body: parse_invokes(body, tool_schemas),
        tools=tools, reasoning_open=reasoning_open, call_id=call_id,
        block_ends_reasoning=True,
    )


def minimax_m2_parser(
    tokenizer: Any,
    *,
    tools: bool,
    call_id: Callable[[], str],
    tool_schemas: dict[str, Any] | None = None,
    reasoning_open: bool = True,
) -> TextReplyParser:
    core = minimax_m2_text(
        tools=tools, call_id=call_id, tool_schemas=tool_schemas, reasoning_open=reasoning_open
    )
    return TextReplyParser(tokenizer, core, MARKERS)
