"""The token ids of recent replies, so that a reply sent back as history hits the cache.

An agent sends the assistant message it received back as history. Its KV is in the cache
under the ids the model *generated*; tokenizing the message's rendered text again need not give
those ids (BPE merges, constrained output), and then the whole reply, and everything after it,
misses. So the server remembers, for a bounded number of recent replies, the ids it generated
(the generation prompt included), keyed by what a client sends back: the reply's tool-call ids
or, for a reply without calls, its content.

Only the tokenization changes, never the text: :func:`as_generated` uses the recorded ids for
a message's segment only where they decode to a prefix of that segment's own rendered text,
and tokenizes the rest of the text (the template's end-of-message markup) after them. Where
the template renders the reply otherwise (MiniMax-M2 puts a newline before a call block that
the model did not write), :func:`partly_generated` keeps the longest such prefix, so the
cache hit ends where the texts part, not at the reply's first token.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = [
    "Recorded", "ReplyRecord", "as_generated", "message_key", "partly_generated", "reply_key",
]

Key = tuple[Any, ...]


def reply_key(content: str | None, call_ids: Sequence[str]) -> Key | None:
    """What identifies a reply a client sends back: its tool-call ids (unique per reply), or,
    without calls, its content text."""
    if call_ids:
        return ("calls", *call_ids)
    if content:
        return ("content", content)
    return None


def message_key(message: dict[str, Any]) -> Key | None:
    """:func:`reply_key` of an assistant message as a client sends it back."""
    calls = message.get("tool_calls") or ()
    ids = [c.get("id") for c in calls if isinstance(c, dict)]
    if calls and (len(ids) != len(calls) or not all(isinstance(i, str) for i in ids)):
        return None
    content = message.get("content")
    return reply_key(content if isinstance(content, str) else None, ids)


class Recorded(NamedTuple):
    """A reply on record: the ids fed and generated, the generation prompt's
    ``reply_start`` ids first."""

    ids: tuple[int, ...]
    reply_start: int


class ReplyRecord:
    """A bounded, least-recently-used map from reply keys to generated ids (thread-safe:
    the HTTP handlers write and read it from worker threads)."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._ids: collections.OrderedDict[Key, Recorded] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, key: Key | None, ids: Sequence[int], reply_start: int = 0) -> None:
        if key is None or self.capacity <= 0 or not ids:
            return
        with self._lock:
            self._ids[key] = Recorded(tuple(ids), reply_start)
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def lookup(self, key: Key | None) -> Recorded | None:
        if key is None:
            return None
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
            return ids


def as_generated(segment: list[int], generated: Sequence[int], tokenizer: Any) -> list[int]:
    """``segment`` (a message's ids as rendered) re-tokenized to start with ``generated``
    (the ids the model produced for it, generation prompt first) where their text is a prefix
    of the segment's text: all of ``generated``, or all but a last stop token (which the
    template may render otherwise). Otherwise ``segment`` itself."""
    text = tokenizer.decode(segment)
    ends = [len(generated)]
    if generated and generated[-1] in tokenizer.eos_ids:
        ends.append(len(generated) - 1)
    for k in ends:
        head = tokenizer.decode(list(generated[:k]))
        if text.startswith(head):
            rest = text[len(head):]
            return [*generated[:k], *(tokenizer.encode(rest) if rest else [])]
    return segment


def partly_generated(segment: list[int], generated: Sequence[int], tokenizer: Any) -> list[int]:
    """``segment`` re-tokenized to start with the longest prefix of ``generated`` whose text
    is a prefix of the segment's text; ``segment`` itself when not even the first id does.

    Bisected on "one of the prefixes ``k`` .. ``k + 3`` matches", which holds for every ``k``
    up to the longest match and for none past it: a prefix that ends inside a multi-byte
    character (up to 3 of its bytes) decodes to U+FFFD and never matches by itself."""
    text = tokenizer.decode(segment)

    def matches(k: int) -> bool:
        return text.startswith(tokenizer.decode(list(generated[:k])))

    lo, hi = 0, len(generated)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if any(matches(k) for k in range(mid, min(mid + 4, len(generated) + 1))):
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return segment
    rest = text[len(tokenizer.decode(list(generated[:lo]))):]
    return [*generated[:lo], *(tokenizer.encode(rest) if rest else [])]
