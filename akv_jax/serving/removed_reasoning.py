"""Reasoning removed from an earlier reply, served as a ``drop`` instead of a cache miss.

Templates re-render earlier turns: harmony leaves out an assistant turn's analysis once a final
answer follows it, Qwen3 its ``<think>`` block once a user message follows, and many clients
strip reasoning before sending history back. The text then differs from what the model
generated, and the reply, with everything after it, misses the cache.

With ``cache.removed_reasoning = "drop"`` (opt-in; the default serves the text as sent), an
assistant message whose reply the server still has on record (:mod:`.reply_record`) is served
as the model generated it, reasoning included, in three segments: ``pre`` (the generated ids
up to the removed text), ``removed`` (the ids of the text the rendering left out) and ``post``
(the rest, then the template's own end of message), with ``removed`` dropped at the message's
last boundary (DESIGN.md §2). Later tokens see exactly the text as sent; the message's own
tokens saw the reasoning, as when it was generated, so the whole reply is found in the cache.

Indices in ``cache`` stay message indices for clients: a message split into segments is
dropped by dropping all of them, and a boundary at a message is the boundary after its last
segment (:func:`segment_history`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from akv_jax.cache.ops import OpHistory

__all__ = ["SplitMessage", "removed_span", "segment_history"]

SplitMessage = tuple[list[int], list[int], list[int]]  # pre (may be empty), removed, post


def _text_prefix(ids: Sequence[int], text: str, start: int, tokenizer: Any) -> int:
    """The most ids (a token boundary) whose text continues ``text`` at ``start``."""
    best = 0
    for k in range(1, len(ids) + 1):
        piece = tokenizer.decode(list(ids[:k]))
        if text.startswith(piece, start):
            best = k
        elif not piece.endswith("\ufffd"):
            break  # a complete character that differs: no longer prefix can match
    return best


def removed_span(
    generated: Sequence[int], segment: Sequence[int], tokenizer: Any, reply_start: int = 0
) -> SplitMessage | None:
    """``segment`` (a message's ids as rendered now) served as ``generated`` (the ids the model
    produced for it, the generation prompt's ``reply_start`` ids first) with a contiguous span
    of them removed: the split ``(pre, removed, post)`` where ``pre + post`` reads as the
    segment's text, or None if the text is not ``generated`` with one span taken out.

    Where several spans would do (the ids before a span equal its last ones: "<t" of a
    byte-spelled ``<think>`` and of ``<tool_call>``), the earliest in the reply is taken:
    the block the template left out, not a shifted copy of it."""
    text = tokenizer.decode(list(segment))
    a = _text_prefix(generated, text, 0, tokenizer)
    at = len(tokenizer.decode(list(generated[:a])))
    # A last stop token may stay out (the template may render it otherwise).
    ends = [len(generated)]
    if generated and generated[-1] in tokenizer.eos_ids:
        ends.append(len(generated) - 1)
    for end in ends:
        for b in range(a + 1, end):
            tail = generated[b:end]
            if _text_prefix(tail, text, at, tokenizer) == len(tail):
                done = at + len(tokenizer.decode(list(tail)))
                rest = text[done:]
                post = [*tail, *(tokenizer.encode(rest) if rest else [])]
                # Shifting the span left keeps pre + post the same ids.
                while a > reply_start and generated[a - 1] == generated[b - 1]:
                    a, b = a - 1, b - 1
                    post.insert(0, generated[b])
                return list(generated[:a]), list(generated[a:b]), post
    return None


def segment_history(
    history: OpHistory, message_segments: Sequence[Sequence[int]], removed: dict[int, int],
    num_segments: int,
) -> OpHistory:
    """A message-indexed ``history`` over segments: message ``i`` is the segments
    ``message_segments[i]`` (ascending); ``removed`` maps each removed-reasoning segment to
    the boundary (segment index) it is dropped at."""
    drops: dict[int, set[int]] = {}
    for seg, b in removed.items():
        drops.setdefault(b, set()).add(seg)
    for b, msgs in history.drops.items():
        at = message_segments[b][-1]
        for m in msgs:
            # A message is dropped at or after its own boundary, so its removed segment is
            # already gone by then: each segment is dropped once.
            drops.setdefault(at, set()).update(
                s for s in message_segments[m] if s not in removed
            )
    repos = tuple(sorted(message_segments[b][-1] for b in history.repos))
    return OpHistory(num_segments, {b: tuple(sorted(s)) for b, s in sorted(drops.items())},
                     repos)
