"""Where each message ends in the rendering of a whole conversation.

:meth:`akv_jax.model.tokenizer.ChatTokenizer.encode_messages` cuts a conversation's rendering
into one segment per message. Where a template renders a message the same whatever follows,
the rendering of the conversation up to it is a prefix of the whole; where it does not
(GPT-OSS's harmony drops reasoning once a final answer follows, Qwen3's and MiniMax-M2's
templates put consecutive tool results in one turn), :func:`message_end` finds the message's
end by aligning the renderings in pieces cut at special-token markers and newlines.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence

# Special-token-like markers and newlines: the pieces rendered texts are aligned by.
_PIECES = re.compile(r"(<\|[^|<>\s]{1,64}\|>|\n)")


def message_end(
    full: str, renderings: Sequence[str], start: int, specials: Sequence[str]
) -> int | None:
    """Where a message ends in ``full``, given ``renderings`` of the conversation up to and
    including it (as the last message, and as a message followed by the generation prompt),
    no earlier than ``start``.

    The first rendering that is a prefix of ``full`` gives the end; that covers templates that
    render the last message differently (e.g. GPT-OSS's harmony: ``<|return|>`` instead of
    ``<|end|>``, and its reasoning kept only at the end). Failing that, some earlier message is
    rendered differently once later ones follow (harmony drops an assistant's reasoning once a
    final answer follows it, or keeps it while none does). Then, in pieces cut at
    special-token markers and newlines, the longest tail of the rendering found in ``full``
    after ``start`` ends the message where it is first found, provided the tail holds more than
    markers and newlines (some of the message's own text). Each rendering is also tried
    without the special tokens and whitespace it ends with, as a turn continued by the next
    message (Qwen3's and MiniMax-M2's templates put consecutive tool results in one turn,
    closed after the last of them): ``full`` must then go on there with no special token, and
    have that closing later; such a candidate wins over the renderings as they are only with a
    longer tail.
    """
    for r in renderings:
        if full.startswith(r) and len(r) >= start:
            return len(r)
    fp = [p for p in _PIECES.split(full) if p]
    f_ends = [0, *itertools.accumulate(len(p) for p in fp)]
    first = bisect.bisect_left(f_ends, start)  # the first piece at or after start
    sep = "\x00"
    hay = sep + sep.join(fp[first:]) + sep
    best: tuple[int, int] | None = None  # (pieces in the tail, end): the first rendering's
    candidates = [(r, "") for r in renderings]
    candidates += [(u, r[len(u) :]) for r in renderings if (u := unclosed(r, specials)) != r]
    for r, closing in candidates:
        rp = [p for p in _PIECES.split(r) if p]

        def find(n: int, rp: list[str] = rp) -> int:
            return hay.find(sep + sep.join(rp[len(rp) - n :]) + sep)

        lo, hi = 0, len(rp)  # the longest tail of the rendering found in full: lo pieces
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if find(mid) >= 0 else (lo, mid - 1)
        tail = rp[len(rp) - lo :]
        if not any(_PIECES.fullmatch(p) is None for p in tail):
            continue  # only markers and newlines: nothing of the message itself
        at = hay[: find(lo)].count(sep)  # pieces of full[first:] before the tail
        end = f_ends[first + at + lo]
        if closing:
            rest = full[end:]
            head = rest.lstrip()
            if rest.startswith(closing) or closing not in rest or any(
                head.startswith(t) for t in specials
            ):
                continue  # not a turn the next message continues
        if best is None or (closing and lo > best[0]):
            best = (lo, end)
    return None if best is None else best[1]


def unclosed(text: str, specials: Sequence[str]) -> str:
    """``text`` without the special tokens and whitespace it ends with."""
    while True:
        out = text.rstrip()
        out = next((out[: -len(t)] for t in specials if t and out.endswith(t)), out)
        if out == text:
            return text
        text = out
