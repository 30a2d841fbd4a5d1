"""Chat templates compiled and rendered the way transformers does it (jinja2 sandbox,
``trim_blocks``/``lstrip_blocks``, its ``tojson``, ``raise_exception``, ``strftime_now`` and
``{% generation %}`` tag, reasoning under every name templates read it by).

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

Message = dict[str, Any]

# A plain ChatML template: the chat format of the tiny test model and the fallback for a
# checkpoint that ships a tokenizer but no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ``tiny-minimax-m2``'s template: the structure of MiniMax-M2's released template (a
# ``]~!b[`` BOS, ``]~b]ROLE\n ... [e~[\n`` messages with the assistant role named ``ai``, a
# default system message when the chat has none, tool results inside ``<response>``, and a
# generation prompt opening ``<think>``), without its tool-call and reasoning rendering.
MINIMAX_M2_TINY_TEMPLATE = (
    "{{ ']~!b[' }}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ ']~b]system\nYou are a helpful assistant.[e~[\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ ']~b]ai\n' + message['content'] + '[e~[\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ ']~b]tool\n<response>' + message['content'] + '</response>[e~[\n' }}"
    "{% else %}{{ ']~b]' + message['role'] + '\n' + message['content'] + '[e~[\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ']~b]ai\n<think>\n' }}{% endif %}"
)
MINIMAX_M2_TINY_SPECIALS = ("]~!b[", "]~b]", "[e~[")
# The chat format of ``tiny-qwen3-moe``: ChatML with Qwen3's reasoning rule, written here from
# its behaviour (not a copy of the released template): an assistant turn's reasoning is
# rendered, as ``<think>\n...\n</think>\n\n`` before its content, only when no user message
# follows it, so appending a user message re-renders earlier assistant turns without their
# reasoning (the segment splitting then finds each message's text in the full rendering); tool
# results are user turns wrapped in ``<tool_response>``; ``enable_thinking=False`` opens the
# generation with an empty think block.
QWEN3_STYLE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"
    "{%- if m.reasoning_content and loop.index0 > ns.last_user %}"
    "{{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)


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


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders templates in
    (raises :class:`jinja2.TemplateSyntaxError`)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def alias_reasoning(messages: Sequence[Message]) -> list[Message]:
    """Give reasoning every name templates read it under (as transformers does)."""
    out = []
    for m in messages:
        r = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append({"thinking": r, **m, "reasoning_content": r} if r is not None else dict(m))
    return out
