"""What a reply parser returns, the parser interface, and the family factory.

A parser is fed the generated token ids one at a time (EOS / stop tokens included) and
answers each with a :class:`ReplyDelta`; the deltas concatenated are exactly the final
:class:`Reply`, so a streamed response and a whole one always agree.
"""

from __future__ import annotations

import abc
import dataclasses
import secrets
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class ToolCall:
    """A finished call; ``arguments`` is a JSON object as a string."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass
class ToolCallDelta:
    """A streamed piece of call number ``index`` (0-based within the reply): ``id`` and
    ``name`` come once, on the call's first delta; the ``arguments`` pieces concatenate to
    the call's final ``arguments``."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclasses.dataclass
class ReplyDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: ReplyDelta) -> ReplyDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        return self


@dataclasses.dataclass
class Reply:
    content: str
    reasoning: str
    tool_calls: list[ToolCall]


class ReplyParser(abc.ABC):
    @abc.abstractmethod
    def push(self, token_id: int) -> ReplyDelta:
        """One generated token (EOS / stop tokens are pushed too)."""

    @abc.abstractmethod
    def finish(self) -> ReplyDelta:
        """Generation ended (EOS, length cut, abort): what was held back."""

    @abc.abstractmethod
    def reply(self) -> Reply:
        """After :meth:`finish`: the whole parse (the deltas concatenated)."""


class ReplyLog:
    """Accumulates deltas into a :class:`Reply`, so ``reply()`` is the deltas' sum by
    construction rather than a second parse that could disagree with the stream."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, list[str]] = {}  # index -> [id, name, *argument pieces]

    def add(self, delta: ReplyDelta) -> ReplyDelta:
        self.content.append(delta.content)
        self.reasoning.append(delta.reasoning)
        for tc in delta.tool_calls:
            if tc.index not in self.calls:
                if tc.id is None or tc.name is None:
                    raise ValueError(f"call {tc.index}'s first delta has no id or name")
                self.calls[tc.index] = [tc.id, tc.name]
            self.calls[tc.index].append(tc.arguments)
        return delta

    def reply(self) -> Reply:
        calls = [
            ToolCall(id=c[0], name=c[1], arguments="".join(c[2:]))
            for _, c in sorted(self.calls.items())
        ]
        return Reply("".join(self.content), "".join(self.reasoning), calls)


FAMILIES = ("harmony", "qwen3", "minimax_m2", "llama3", "plain")

_ARCH_FAMILY = {
    "gpt_oss": "harmony",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "minimax_m2": "minimax_m2",
    "llama": "llama3",
}


def family_for(arch: str) -> str:
    """``ModelConfig.arch`` -> the reply format family ("plain" when none is known)."""
    return _ARCH_FAMILY.get(arch, "plain")


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a ``<think>`` block open (its last ``<think>`` comes
    after its last ``</think>``), as Qwen3-Thinking-2507's and MiniMax-M2's generation
    prompts do: the ``reasoning_open`` to pass to :func:`reply_parser` (vLLM asks the same
    of the prompt's ids). A prompt that closed an empty block (Qwen3 with
    ``enable_thinking=False``) or never opened one gives False."""
    return prompt_text.rfind("<think>") > prompt_text.rfind("</think>")


def default_call_id() -> str:
    """An OpenAI-style call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def reply_parser(
    family: str,
    tokenizer: Any,
    *,
    tools: bool,
    call_id: Callable[[], str] | None = None,
    tool_schemas: dict[str, Any] | None = None,
    reasoning_open: bool | None = None,
) -> ReplyParser:
    """A fresh parser for one reply.

    ``tokenizer`` is a :class:`akv_jax.model.tokenizer.ChatTokenizer`. ``tools=False`` (no
    tools declared) leaves the text families' call markup in the content; harmony always
    parses its channels and reports calls. ``tool_schemas`` (tool name -> its parameters'
    JSON schema, for every declared tool) types MiniMax-M2's parameter values and names the
    tools its invokes may call. ``reasoning_open`` says the prompt ended inside an open
    ``<think>`` block (see :func:`prompt_opens_reasoning`), so the reply starts as reasoning;
    by default true for MiniMax-M2 (its generation prompt opens one) and false for Qwen3 (the
    model writes ``<think>`` itself, or the prompt closed an empty block).
    """
    # Imported here: each family module imports this one for the types.
    from akv_jax.formats import harmony_reply, llama3_reply, minimax_m2_reply, qwen3_reply
    from akv_jax.formats.text_scan import PlainText, TextReplyParser

    ids = call_id or default_call_id
    if family == "harmony":
        return harmony_reply.HarmonyReplyParser(tokenizer, call_id=ids)
    if family == "qwen3":
        return qwen3_reply.qwen3_parser(
            tokenizer, tools=tools, call_id=ids, reasoning_open=bool(reasoning_open)
        )
    if family == "minimax_m2":
        return minimax_m2_reply.minimax_m2_parser(
            tokenizer, tools=tools, call_id=ids, tool_schemas=tool_schemas,
            reasoning_open=True if reasoning_open is None else reasoning_open,
        )
    if family == "llama3":
        return llama3_reply.llama3_parser(tokenizer, tools=tools, call_id=ids)
    if family == "plain":
        return TextReplyParser(tokenizer, PlainText(), markers=())
    raise ValueError(f"unknown reply family {family!r} (known: {', '.join(FAMILIES)})")
