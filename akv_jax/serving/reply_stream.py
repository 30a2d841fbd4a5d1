"""One reply's generated ids turned into what an OpenAI client reads: content, reasoning and
tool calls, as deltas while they stream and as a whole at the end.

A model family with a reply format goes through its parser (:mod:`akv_jax.formats.reply`);
the content it yields is cut at the request's stop strings. The ``plain`` family is decoded
as text only (special tokens left out), as before there were parsers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from akv_jax.formats.reply import Reply, ReplyDelta, ReplyParser
from akv_jax.serving.detok import StopFilter, TextStream

__all__ = ["ReplyStream", "merged"]


def merged(a: ReplyDelta, b: ReplyDelta) -> ReplyDelta:
    """``a`` then ``b`` as one delta."""
    return ReplyDelta(a.content + b.content, a.reasoning + b.reasoning,
                      [*a.tool_calls, *b.tool_calls])


class ReplyStream:
    def __init__(self, tokenizer: Any, parser: ReplyParser | None, stop: Sequence[str] = ()):
        self.parser = parser
        self.text = TextStream(tokenizer, stop) if parser is None else None
        self.content = StopFilter(stop)
        self._finished = False

    @property
    def stopped(self) -> bool:
        """A stop string ended the content: the generation should end here."""
        return self.text.stopped if self.text is not None else self.content.stopped

    def push(self, token_id: int, stop_token: bool = False) -> ReplyDelta:
        """One generated id. ``stop_token``: the id that ended the generation (EOS or a stop
        id): not text, but a parser may need it (harmony's ``<|call|>``)."""
        if self.text is not None:
            return ReplyDelta(content="" if stop_token else self.text.push(token_id))
        return self._filtered(self.parser.push(token_id))

    def finish(self) -> ReplyDelta:
        """The rest, once the generation has ended (idempotent)."""
        if self._finished:
            return ReplyDelta()
        self._finished = True
        if self.text is not None:
            return ReplyDelta(content=self.text.finish())
        d = self._filtered(self.parser.finish())
        return merged(d, ReplyDelta(content=self.content.push("", final=True)))

    def _filtered(self, d: ReplyDelta) -> ReplyDelta:
        return ReplyDelta(self.content.push(d.content), d.reasoning, d.tool_calls)

    def reply(self) -> Reply:
        """The whole reply (after :meth:`finish`)."""
        if self.text is not None:
            return Reply(self.text.text, "", [])
        r = self.parser.reply()
        return Reply(self.content.text, r.reasoning, r.tool_calls)
