"""Incremental detokenization with stop strings, for chat responses.

Decoding token by token is wrong for byte-level BPE (a character can span tokens), and
decoding the whole output at every step is quadratic. :class:`TextStream` keeps a short
window (the technique vLLM and TGI use): it decodes ``ids[prefix:]`` and ``ids[prefix:read]``
and emits the difference, holding back text while it ends in an incomplete character.

Stop strings are matched on the text; text that could be the start of a stop string is held
back until it is known not to be, so a streamed client never sees part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class StopFilter:
    """Text in, text out, cut at the first stop string: text that could be the start of a
    stop string is held back until it is known not to be."""

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = tuple(stop)
        self.text = ""  # all text so far (held-back text included; cut at a stop string)
        self._sent = 0  # chars of self.text already returned
        self.stopped = False

    def push(self, text: str, final: bool = False) -> str:
        """Add ``text``; return what is now safe to emit ('' if nothing). ``final``: no more
        text follows, so nothing is held back."""
        if self.stopped:
            return ""
        self.text += text
        if self.stop:
            # Sent text never holds the start of a stop string (see _held_back), so the
            # search can begin at the first unsent character.
            hits = [i for i in (self.text.find(s, self._sent) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                out = self.text[self._sent :]
                self._sent = len(self.text)
                return out
        end = len(self.text) if final else len(self.text) - self._held_back()
        end = max(end, self._sent)
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best


class TextStream:
    """Token ids in, text out (see the module docstring), cut at stop strings."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()):
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already turned into text
        self.filter = StopFilter(stop)

    @property
    def text(self) -> str:
        return self.filter.text

    @property
    def stopped(self) -> bool:
        return self.filter.stopped

    def push(self, token_id: int) -> str:
        """Add a token; return the text that is now safe to emit ('' if none)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return self.filter.push(new_text[len(prefix_text) :])
        return self.filter.push("")

    def finish(self) -> str:
        """The rest of the text at the end of generation (held-back text is released)."""
        rest = ""
        if not self.stopped and self._read < len(self.ids):
            prefix_text = self._decode(self.ids[self._prefix : self._read])
            rest = self._decode(self.ids[self._prefix :])[len(prefix_text) :]
            self._read = len(self.ids)
        return self.filter.push(rest, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if ids else ""
