"""Chat templates compiled and rendered the way transformers does it (jinja2 sandbox,
``trim_blocks``/``lstrip_blocks``, its ``tojson``, ``raise_exception``, ``strftime_now`` and
``{% generation %}`` tag, reasoning under every name templates read it by), and the chat
formats of the tiny random models (the released Qwen3 and MiniMax-M2 templates are in
:mod:`akv_jax.model.released_templates`).

Errors are jinja2's own (:class:`jinja2.TemplateError`); :class:`~akv_jax.model.tokenizer.
ChatTokenizer` turns them into its ``TokenizerError``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from akv_jax.model.released_templates import MINIMAX_M2_TEMPLATE

Message = dict[str, Any]


def _edited(source: str, *edits: tuple[str, str]) -> str:
    """``source`` with each ``(old, new)`` replaced, every ``old`` occurring exactly once."""
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"template edit does not apply once: {old!r}")
        source = source.replace(old, new)
    return source


# A plain ChatML template: the chat format of the tiny test model and the fallback for a
# checkpoint that ships a tokenizer but no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ``tiny-minimax-m2``'s template: MiniMax-M2's released template
# (:data:`~akv_jax.model.released_templates.MINIMAX_M2_TEMPLATE`) with two edits, each checked to
# apply once: a tool call's arguments may also be a JSON string (what OpenAI clients send; the
# released text iterates them as a mapping, so it is parsed with ``fromjson``), and a tool message
# that follows no tool call is rendered instead of refused.
MINIMAX_M2_TINY_TEMPLATE = _edited(
    MINIMAX_M2_TEMPLATE,
    (
        "{% set _args = tool_call.arguments %}",
        "{% set _args = tool_call.arguments | fromjson if tool_call.arguments is string"
        " else tool_call.arguments %}",
    ),
    (
        "    {%- if last_tool_call.name is none -%}\n"
        "        {{- raise_exception(\"Message has tool role, but there was no previous assistant"
        " message with a tool call!\") }}\n"
        "    {%- endif -%}\n",
        "",
    ),
)
MINIMAX_M2_TINY_SPECIALS = ("]~!b[", "]~b]", "[e~[")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' assistant-mask tag, rendered
    as its body (we never need the mask, but templates using the tag must still compile)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers replaces jinja's tojson, which would HTML-escape the output.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _fromjson(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise jinja2.exceptions.TemplateError(f"not JSON ({e}): {text[:80]!r}") from None


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders templates in
    (raises :class:`jinja2.TemplateSyntaxError`)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters["fromjson"] = _fromjson  # ours (tiny-minimax-m2's template), not transformers'
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def alias_reasoning(messages: Sequence[Message]) -> list[Message]:
    """Give reasoning every name templates read it under (as transformers does), and a null
    content the empty string (an OpenAI tool-call message's content is null, and released
    templates use content as a string: Qwen3's tests ``'</think>' in content``, MiniMax-M2's
    would print ``None``)."""
    out = []
    for m in messages:
        r = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        m = {"thinking": r, **m, "reasoning_content": r} if r is not None else dict(m)
        if "content" in m and m["content"] is None:
            m["content"] = ""
        out.append(m)
    return out
