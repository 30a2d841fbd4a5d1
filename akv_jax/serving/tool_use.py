"""What a chat request's ``tools``, ``tool_choice`` and ``response_format`` mean for the served
model: the parser its reply goes through, and the grammar its decoding is held to.

The model's family (from the checkpoint's architecture, or ``--reply-format``) picks both:
GPT-OSS replies are harmony (openai-harmony parses them), Qwen3 and Qwen3-MoE hermes-style
``<tool_call>`` blocks with ``<think>`` reasoning, MiniMax-M2 its XML calls, Llama JSON calls.

``tool_choice`` ``required`` or a named function, and ``response_format`` ``json_object`` or
``json_schema``, constrain decoding (:mod:`akv_jax.formats.constraint`): the model may reason
first, within ``reasoning_budget`` tokens, then must emit a valid call (arguments valid for the
function's schema) or document. ``auto`` parses whatever the model writes; ``none`` reports no
calls. Everything that depends on the model is checked here and refused with a 400 naming the
field: tools for a template that cannot render them, a schema the grammar engine cannot
compile.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from akv_jax.errors import InvalidField
from akv_jax.formats.constraint import GrammarCompiler, GrammarError, TokenConstraint
from akv_jax.formats.reply import (
    ReplyParser,
    family_for,
    prompt_opens_reasoning,
    reply_parser,
)
from akv_jax.serving.protocol import ChatInput

__all__ = ["ToolUse"]

# A template that never names ``tools`` cannot show the model the functions it may call.
_TOOLS_VARIABLE = re.compile(r"\btools\b")


class ToolUse:
    """The reply format of one served model (one per server)."""

    def __init__(self, tokenizer: Any, arch: str, logits_width: int, *,
                 family: str | None = None, reasoning_budget: int = 256):
        self.tokenizer = tokenizer
        self.family = family or family_for(arch)
        self.logits_width = logits_width
        self.reasoning_budget = reasoning_budget
        template = getattr(tokenizer, "chat_template", None) or ""
        self.template_has_tools = bool(_TOOLS_VARIABLE.search(template))
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar engine's view of the vocabulary, built on first use (seconds on a
        200k vocabulary: call it from a worker thread)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.logits_width, self.family)
            return self._compiler

    def check(self, inp: ChatInput) -> None:
        """Refuse what this model cannot do with the request's tools (400 naming the field)."""
        if inp.tools and not self.template_has_tools:
            raise InvalidField("tools", "this model's chat template cannot render tools")

    def constraint(
        self, inp: ChatInput, max_tokens: int, reasoning_open: bool = False
    ) -> TokenConstraint | None:
        """The grammar ``inp``'s decoding is held to, or None (free decoding);
        ``reasoning_open``: the generation prompt left a ``<think>`` block open
        (:meth:`opens_reasoning`). Compiles the schemas: a blocking call, for a worker
        thread."""
        budget = min(self.reasoning_budget, max(0, max_tokens // 2))
        choice = inp.tool_choice
        if choice == "required" or isinstance(choice, dict):
            names = None if choice == "required" else [choice["function"]["name"]]
            for i, t in enumerate(inp.tools or ()):
                schema = t["function"].get("parameters")
                if schema is not None:
                    self._check_schema(schema, f"tools[{i}].function.parameters")
            try:
                return self.compiler.tool_calls(
                    inp.tools or [], names=names,
                    parallel=inp.parallel_tool_calls and names is None,
                    reasoning_budget=budget, reasoning_open=reasoning_open,
                )
            except GrammarError as e:
                raise InvalidField("tools", str(e)) from None
        fmt = inp.response_format
        if fmt is None:
            return None
        schema = None
        if fmt["type"] == "json_schema":
            schema = fmt["json_schema"].get("schema")
            if schema is not None:
                self._check_schema(schema, "response_format.json_schema.schema")
        try:
            return self.compiler.json_document(
                schema, reasoning_budget=budget, reasoning_open=reasoning_open
            )
        except GrammarError as e:
            raise InvalidField("response_format", str(e)) from None

    def _check_schema(self, schema: dict[str, Any], field: str) -> None:
        try:
            self.compiler.check_schema(schema)
        except GrammarError as e:
            raise InvalidField(field, str(e)) from None

    def opens_reasoning(self, gen_prompt: list[int]) -> bool:
        """Whether the generation prompt (its ids) leaves a ``<think>`` block open, so the
        reply starts as reasoning: MiniMax-M2's always, Qwen3-Thinking-2507's; not Qwen3's
        with ``enable_thinking`` false (it closes an empty block)."""
        if self.family == "minimax_m2":
            return True
        return self.family == "qwen3" and prompt_opens_reasoning(
            self.tokenizer.decode(gen_prompt)
        )

    def parser(self, inp: ChatInput, reasoning_open: bool = False) -> ReplyParser:
        """A fresh parser for one reply; with ``tool_choice`` none, calls are not parsed."""
        schemas = {t["function"]["name"]: t["function"].get("parameters")
                   for t in inp.tools or ()}
        return reply_parser(self.family, self.tokenizer, tools=inp.tool_choice != "none",
                            tool_schemas=schemas or None, reasoning_open=reasoning_open)
