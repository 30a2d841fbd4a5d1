"""Shared pieces of the text-format parsers (Qwen3, MiniMax-M2, Llama 3, plain).

Their parse is a state machine over decoded *text*, fed in whatever chunks the tokens give,
so the result never depends on how a marker was split into tokens (Qwen3's ``<think>`` is one
special token in its own vocabulary and seven bytes in the tiny test one). Text that could
still become a marker is held back until it is known, so streamed text never ends in half a
``<tool_ca``.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Sequence
from typing import Any

from akv_jax.formats.reply import Reply, ReplyDelta, ReplyLog, ReplyParser, ToolCallDelta

THINK_START, THINK_END = "<think>", "</think>"


# --------------------------------------------------------------------------- scanning


def first_marker(text: str, markers: Sequence[str]) -> tuple[int, str] | None:
    """The earliest complete occurrence of any marker: (position, marker), or None."""
    best: tuple[int, str] | None = None
    for m in markers:
        i = text.find(m)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, m)
    return best


def partial_suffix_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker: the
    text to hold back because the next chunk may complete the marker."""
    longest = max((len(m) for m in markers), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(len(m) > k and m.startswith(tail) for m in markers):
            return k
    return 0


class Trimmed:
    """One output channel with its surrounding whitespace stripped (the newlines around
    ``<think>`` blocks are format, not text: Qwen3's own template strips them when the turn
    is sent back): leading whitespace is dropped, trailing whitespace is held until more
    text follows it, and dropped at the end."""

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body) :]
        return body


def refuse_constant(name: str) -> Any:
    """``parse_constant`` for json: NaN / Infinity are not JSON."""
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> Any:
    """``json.loads`` refusing NaN / Infinity."""
    return json.loads(text, parse_constant=refuse_constant)


def dumps_strict(value: Any) -> str:
    """Arguments as vLLM writes them (``ensure_ascii=False``), refusing non-JSON floats
    (``1e400`` parses to inf) so an arguments string is always valid JSON."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


# --------------------------------------------------------------------------- decoding


class TokenText:
    """Incremental detokenization that keeps a family's markup tokens.

    Ordinary ids are decoded with the window technique of ``akv_jax.serving.detok`` (that
    module is not imported: the serving layer imports this package), skipping special
    tokens; a markup id (``<think>``, ``<tool_call>``... when the vocabulary has them as
    tokens) flushes the window and is emitted as its literal text, which skipping special
    tokens would otherwise hide. EOS ids give no text.
    """

    def __init__(self, tokenizer: Any, markers: Sequence[str]):
        self.tok = tokenizer
        self.markup = {
            tid: m for m in markers if (tid := tokenizer.token_to_id(m)) is not None
        }
        self.eos = set(tokenizer.eos_ids)
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # ids before this are already text

    def push(self, token_id: int) -> str:
        if token_id in self.eos:
            return ""
        if token_id in self.markup:
            return self.flush() + self.markup[token_id]
        self.ids.append(token_id)
        before = self.decode(self.ids[self.prefix : self.read])
        now = self.decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            del self.ids[: self.read]  # the new window starts at the old read point
            self.prefix, self.read = 0, len(self.ids)
            return now[len(before) :]
        return ""  # an incomplete character: wait for its other bytes

    def flush(self) -> str:
        """The text still held (an incomplete character decodes as U+FFFD)."""
        out = ""
        if self.read < len(self.ids):
            before = self.decode(self.ids[self.prefix : self.read])
            out = self.decode(self.ids[self.prefix :])[len(before) :]
        self.ids, self.prefix, self.read = [], 0, 0
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if ids else ""


# --------------------------------------------------------------------------- parsers


class TextCore(abc.ABC):
    """A family's text state machine: decoded text in, deltas out."""

    @abc.abstractmethod
    def feed(self, text: str) -> ReplyDelta: ...

    @abc.abstractmethod
    def close(self) -> ReplyDelta:
        """The end of the text: release or resolve whatever is held."""


class BufferedText(TextCore):
    """A state machine over buffered text: what is fed is appended to ``buf`` and
    :meth:`run` takes out what it can decide (everything, at the end)."""

    buf: str

    def feed(self, text: str) -> ReplyDelta:
        self.buf += text
        return self.run(final=False)

    def close(self) -> ReplyDelta:
        return self.run(final=True)

    @abc.abstractmethod
    def run(self, final: bool) -> ReplyDelta: ...


class PlainText(TextCore):
    """Everything is content, as generated."""

    def feed(self, text: str) -> ReplyDelta:
        return ReplyDelta(content=text)

    def close(self) -> ReplyDelta:
        return ReplyDelta()


class TextReplyParser(ReplyParser):
    """Tokens -> :class:`TokenText` -> a :class:`TextCore`, with the deltas logged."""

    def __init__(self, tokenizer: Any, core: TextCore, markers: Sequence[str]):
        self.text = TokenText(tokenizer, markers)
        self.core = core
        self.log = ReplyLog()
        self.finished = False

    def push(self, token_id: int) -> ReplyDelta:
        if self.finished:
            return ReplyDelta()
        text = self.text.push(token_id)
        return self.log.add(self.core.feed(text) if text else ReplyDelta())

    def finish(self) -> ReplyDelta:
        if self.finished:
            return ReplyDelta()
        self.finished = True
        delta = self.core.feed(self.text.flush())
        delta += self.core.close()
        return self.log.add(delta)

    def reply(self) -> Reply:
        return self.log.reply()


# parse_block(body) -> [(name, arguments JSON)], or None when the block is not a valid call
BlockParser = Callable[[str], list[tuple[str, str]] | None]


class TaggedText(BufferedText):
    """Optional ``<think>...</think>`` reasoning, then content with tool-call blocks
    (``START body END``): the shape Qwen3 (hermes) and MiniMax-M2 share.

    - ``reasoning_open``: the prompt opened the think block, so the text starts as
      reasoning; otherwise it is reasoning only when it starts with ``<think>``.
    - A block is held whole until its end marker and then parsed: a valid one becomes calls,
      any other goes to content as the text it was (a half-written call is never streamed
      and never becomes a call). ``parse_unclosed``: a block the reply ends inside is parsed
      too (vLLM's hermes regex takes ``<tool_call>(.*)`` at the end); otherwise it is content.
    - ``block_ends_reasoning``: a block start inside reasoning ends the reasoning.
    - ``tools=False``: no blocks; their markup stays in the content.
    """

    def __init__(
        self,
        *,
        block: tuple[str, str],
        parse_block: BlockParser,
        tools: bool,
        reasoning_open: bool,
        call_id: Callable[[], str],
        parse_unclosed: bool = False,
        block_ends_reasoning: bool = False,
    ):
        self.block_start, self.block_end = block
        self.parse_block = parse_block
        self.tools = tools
        self.reasoning_open = reasoning_open
        self.call_id = call_id
        self.parse_unclosed = parse_unclosed
        self.think_ends = (THINK_END, self.block_start) if (
            tools and block_ends_reasoning
        ) else (THINK_END,)
        self.content_marks = (self.block_start,) if tools else ()
        self.state = "start"
        self.buf = ""
        self.searched = 0  # how much of a held block's text has been searched for its end
        self.reasoning = Trimmed()
        self.content = Trimmed()
        self.n_calls = 0

    def run(self, final: bool) -> ReplyDelta:
        out = ReplyDelta()
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(THINK_START):
                    self.buf, self.state = s[len(THINK_START) :], "think"
                    continue
                if not final and THINK_START.startswith(s):
                    return out  # nothing yet, or what may become <think>
                self.state = "think" if self.reasoning_open else "content"
            elif self.state == "think":
                hit = first_marker(self.buf, self.think_ends)
                if hit is None:
                    out.reasoning += self.reasoning.push(self.release(self.think_ends, final))
                    return out
                pos, mark = hit
                out.reasoning += self.reasoning.push(self.buf[:pos])
                # </think> is consumed; a block start stays for the content state to see
                self.buf = self.buf[pos + len(mark) :] if mark == THINK_END else self.buf[pos:]
                self.state = "content"
            elif self.state == "content":
                hit = first_marker(self.buf, self.content_marks)
                if hit is None:
                    out.content += self.content.push(self.release(self.content_marks, final))
                    return out
                pos, mark = hit
                out.content += self.content.push(self.buf[:pos])
                self.buf, self.state = self.buf[pos + len(mark) :], "block"
            else:  # inside a block
                # (a long block is searched once, not again at every feed)
                end = self.buf.find(self.block_end, max(0, self.searched - len(self.block_end)))
                if end < 0 and not final:
                    self.searched = len(self.buf)
                    return out
                self.searched = 0
                closed = end >= 0
                body = self.buf[:end] if closed else self.buf
                self.buf = self.buf[end + len(self.block_end) :] if closed else ""
                calls = self.parse_block(body) if closed or self.parse_unclosed else None
                if calls is None:
                    raw = self.block_start + body + (self.block_end if closed else "")
                    out.content += self.content.push(raw)
                for name, arguments in calls or ():
                    out.tool_calls.append(
                        ToolCallDelta(self.n_calls, self.call_id(), name, arguments)
                    )
                    self.n_calls += 1
                self.state = "content"

    def release(self, markers: Sequence[str], final: bool) -> str:
        """Take the buffer except a tail that may still become one of ``markers``."""
        cut = len(self.buf) - (0 if final else partial_suffix_len(self.buf, markers))
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out
