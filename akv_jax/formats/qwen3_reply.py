"""Qwen3 / Qwen3-MoE replies: ``<think>\\n...\\n</think>\\n\\n`` reasoning, then content and
hermes-style calls ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Reasoning follows vLLM's Qwen3 reasoning parser (vllm/reasoning/qwen3_reasoning_parser.py; the
parses are checked against vLLM 0.32's by tests/fixtures/parser_golden.json): a ``<think>`` the
model writes is dropped, text up to ``</think>`` is reasoning, and a reply cut off before
``</think>`` is all reasoning. vLLM decides from the prompt (and ``enable_thinking``) whether
the reply starts inside the block; here the server says so with ``reasoning_open`` (see
``reply.prompt_opens_reasoning``), and otherwise a reply that does not start with ``<think>``
is content. A hermes ``<tool_call>`` written inside ``<think>`` stays reasoning, as in vLLM's
file-based parser (which ends reasoning at ``<tool_call>`` only before ``<function=``; its
0.32 parser engine ends it at any ``<tool_call>``). Calls follow vLLM's hermes parser
(vllm/tool_parsers/hermes_tool_parser.py): the block's JSON needs a ``name``, and its
``arguments`` object is re-serialised with ``json.dumps(..., ensure_ascii=False)``; a block
whose JSON does not parse stays content. Unlike vLLM, which keeps only the text before the
first call, content after or between calls is kept.
"""

from __future__ import annotations

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

TOOL_CALL = ("<tool_call>", "</tool_call>")
MARKERS = (THINK_START, THINK_END, *TOOL_CALL)


def parse_hermes_call(body: str) -> list[tuple[str, str]] | None:
    """A ``<tool_call>`` body -> [(name, arguments)], or None when it is not a call.

    ``arguments`` may be absent (no arguments: ``{}``) or, as some models write it, a string
    holding the JSON object; anything but an object is refused so arguments always are one.
    """
    try:
        obj = loads_strict(body)
        if not isinstance(obj, dict):
            return None
        name, args = obj.get("name"), obj.get("arguments", {})
        if isinstance(args, str):
            args = loads_strict(args)
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        return [(name, dumps_strict(args))]
    except (ValueError, RecursionError):
        return None


def qwen3_text(
    *, tools: bool, call_id: Callable[[], str], reasoning_open: bool = False
) -> TaggedText:
    """The text state machine (fed decoded text; the tests feed it directly)."""
    return TaggedText(
        block=TOOL_CALL, parse_block=parse_hermes_call, tools=tools,
        reasoning_open=reasoning_open, call_id=call_id, parse_unclosed=True,
    )


def qwen3_parser(
    tokenizer: Any, *, tools: bool, call_id: Callable[[], str], reasoning_open: bool = False
) -> TextReplyParser:
    core = qwen3_text(tools=tools, call_id=call_id, reasoning_open=reasoning_open)
    return TextReplyParser(tokenizer, core, MARKERS)
