"""Llama 3 replies: a reply that is one or more JSON calls ``{"name": ..., "parameters":
{...}}`` (optionally after ``<|python_tag|>``, several separated by ``;``) is tool calls;
anything else is content. No reasoning.

Follows vLLM's ``llama3_json`` parser (vllm/tool_parsers/llama_tool_parser.py): a reply is a
call candidate when it starts with ``<|python_tag|>`` or ``{`` (its streaming rule), takes
``arguments`` or else ``parameters``, and re-serialises them with ``ensure_ascii=False``; if
any object is not a call the whole reply is content. A candidate is held until the reply ends
(a call is known to be whole only then); other replies stream as content, untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from akv_jax.formats.reply import ReplyDelta, ToolCallDelta
from akv_jax.formats.text_scan import (
    BufferedText,
    TextReplyParser,
    dumps_strict,
    refuse_constant,
)

PYTHON_TAG = "<|python_tag|>"
MARKERS = (PYTHON_TAG,)


def parse_json_calls(text: str) -> list[tuple[str, str]] | None:
    """``[<|python_tag|>] {call} [; {call}]...`` -> [(name, arguments)], or None."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG) :]
    decoder = json.JSONDecoder(parse_constant=refuse_constant)
    calls, pos = [], 0
    try:
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            obj, pos = decoder.raw_decode(text, pos)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
            if not obj["name"] or not isinstance(args, dict):
                return None
            calls.append((obj["name"], dumps_strict(args)))
            rest = text[pos:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            pos = len(text) - len(rest) + 1
    except (ValueError, RecursionError):
        return None


class Llama3Text(BufferedText):
    def __init__(self, *, tools: bool, call_id: Callable[[], str]):
        self.tools = tools
        self.call_id = call_id
        self.state = "start" if tools else "content"
        self.buf = ""

    def run(self, final: bool) -> ReplyDelta:
        if self.state == "start":
            s = self.buf.lstrip()
            if s.startswith((PYTHON_TAG, "{")):
                self.state = "candidate"
            elif not final and PYTHON_TAG.startswith(s):
                return ReplyDelta()  # nothing yet, or what may become the tag
            else:
                self.state = "content"
        if self.state == "content":
            out, self.buf = self.buf, ""
            return ReplyDelta(content=out)
        if not final:
            return ReplyDelta()
        calls = parse_json_calls(self.buf)
        if calls is None:
            out, self.buf = self.buf, ""
            return ReplyDelta(content=out)
        self.buf = ""
        return ReplyDelta(
            tool_calls=[ToolCallDelta(i, self.call_id(), n, a) for i, (n, a) in enumerate(calls)]
        )


def llama3_text(*, tools: bool, call_id: Callable[[], str]) -> Llama3Text:
    """The text state machine (fed decoded text; the tests feed it directly)."""
    return Llama3Text(tools=tools, call_id=call_id)


def llama3_parser(tokenizer: Any, *, tools: bool, call_id: Callable[[], str]) -> TextReplyParser:
    return TextReplyParser(tokenizer, llama3_text(tools=tools, call_id=call_id), MARKERS)
