"""/generate bodies whose token-id segments were seen before: parsed and checked once.

An agent resends its whole history every turn, so almost every segment of a request's
``input_ids`` is one it (or another agent sharing its prompt) sent before, byte for byte.
:class:`SegmentMemo` keeps each segment's validated int32 array under its JSON text: a body
is split into its segments by array scans over its bytes, a known segment costs a dict
lookup, and only new segments are parsed (orjson) and checked. A turn's parse then costs
the bytes it scans plus what is new, not a Python object per history token.

The fast path takes only what it can prove it reads as ``json.loads`` would: a body that
opens with ``{"input_ids": [`` and whose ``input_ids`` is a list of non-empty lists of
in-range integers written with digits, commas, brackets and white space. Anything else
(another key order, a flat list, a bad token) returns None, as does a rest of the body that
does not parse (the caller's check), and the caller parses the body the general way, which
words every error.

A session's next body starts with the bytes of its last one up to the end of that one's last
segment. The memo keeps that prefix of each body it split (with its arrays), found by the
bytes up to the body's first segment's end; a body that starts with a kept prefix is scanned
only from there. A turn's parse then costs its new segments and the bytes after them, not
its history.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import numpy as np
import orjson

_HEAD = re.compile(rb'\s*\{\s*"input_ids"\s*:\s*\[')
_WHITE = b" \t\n\r"
_ID_BYTES = b"0123456789,[]" + _WHITE  # what an input_ids of token-id lists may hold
_INT32_END = 2**31
# Kept prefixes that share a first segment (often a system prompt): a body is checked
# against each, and a session's branches (a retried turn) each keep theirs.
PREFIXES_PER_HEAD = 32


class SegmentMemo:
    """Validated segments of /generate bodies by their JSON text, and bodies' prefixes, least
    recently used first out past ``max_bytes`` (texts, arrays and prefixes together). One
    thread uses it (the event loop's)."""

    def __init__(self, vocab_size: int | None, max_bytes: int = 64 << 20):
        self.end = _INT32_END if vocab_size is None else min(vocab_size, _INT32_END)
        self.max_bytes = max_bytes
        self._arrays: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        # Bodies' prefixes through their last segment, by the bytes through their first
        # segment: {head: {prefix: its arrays}}, least recently used first out past max_bytes.
        self._prefixes: OrderedDict[bytes, OrderedDict[bytes, tuple[np.ndarray, ...]]] = (
            OrderedDict())
        self._prefix_bytes = 0
        self.hits = 0  # segments not parsed: found by their text or in a kept prefix
        self.misses = 0
        self.prefix_hits = 0  # bodies scanned from a kept prefix

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def nbytes(self) -> int:
        """Bytes held: segment texts, their arrays and the kept prefixes."""
        return self._bytes + self._prefix_bytes

    def split(self, raw: bytes) -> tuple[bytes, list[np.ndarray]] | None:
        """``raw`` as (the body with ``input_ids`` emptied, ``[]``, for the caller to parse;
        the segments as int32 arrays), or None when the fast path does not apply (see the
        module docstring)."""
        head = _HEAD.match(raw)
        if head is None:
            return None
        start = head.end()  # just past the "[" that opens input_ids
        first_end = raw.find(b"]", start) + 1  # through the first segment, if well formed
        first = raw[:first_end]
        known = self._known_prefix(first, raw) if first_end else None
        if known is None:
            pos, segments = start, []
        else:
            pos, segments = len(known[0]), list(known[1])
        scanned = self._scan(raw, pos, resumed=known is not None)
        if scanned is None:
            return None
        end, spans = scanned
        for a, z in spans:
            arr = self._segment(raw[a:z])
            if arr is None:
                return None
            segments.append(arr)
        if not segments:
            return None
        last_end = spans[-1][1] if spans else pos
        self._remember(first, raw[:last_end], tuple(segments))
        return raw[:start] + b"]" + raw[end + 1 :], segments

    @staticmethod
    def _scan(raw: bytes, pos: int, resumed: bool) -> tuple[int, list[tuple[int, int]]] | None:
        """From ``pos`` in ``input_ids`` (just past its opening "[", or just past a segment
        when ``resumed``): the index of the "]" that closes it and the (start, end) of each
        segment on the way, or None unless they are plain lists of digits."""
        b = np.frombuffer(raw, np.uint8)[pos:]
        brackets = np.flatnonzero((b == ord("[")) | (b == ord("]")))
        # A list of flat lists: "[" and "]" alternate until the "]" that closes input_ids
        # stands where a "[" would come (a "[" where a "]" would is nesting: not ours).
        off = np.flatnonzero((b[brackets] == ord("[")) != (np.arange(len(brackets)) % 2 == 0))
        if not len(off) or off[0] % 2 or (off[0] == 0 and not resumed):
            return None
        n = int(off[0]) // 2
        end = pos + int(brackets[2 * n])  # the "]" that closes input_ids
        if raw[pos:end].translate(None, _ID_BYTES):
            return None  # something besides digits, commas, brackets and white space
        opens = (brackets[0 : 2 * n : 2] + pos).tolist()
        closes = (brackets[1 : 2 * n : 2] + pos + 1).tolist()
        # Between segments exactly one comma (and white space); none before the first
        # segment of the list or after the last.
        bounds = [pos, *(x for pair in zip(opens, closes, strict=True) for x in pair), end]
        gaps = [raw[bounds[i] : bounds[i + 1]].strip(_WHITE) for i in range(0, len(bounds), 2)]
        comma = [resumed and n > 0, *([True] * (n - 1)), False] if n else [False]
        if any(g != (b"," if c else b"") for g, c in zip(gaps, comma, strict=True)):
            return None
        return end, list(zip(opens, closes, strict=True))

    def _known_prefix(self, head: bytes, raw: bytes
                      ) -> tuple[bytes, tuple[np.ndarray, ...]] | None:
        """The longest kept prefix that ``raw`` starts with (and the arrays of its
        segments), among those with the same first segment ``head``."""
        kept = self._prefixes.get(head)
        if not kept:
            return None
        # Longest first, each checked at its end before in full: a sibling (the same history
        # with another last segment) differs there, and the first full match is the longest.
        for best in sorted(kept, key=len, reverse=True):
            n = len(best)
            if raw[max(0, n - 64) : n] == best[-64:] and raw.startswith(best):
                break
        else:
            return None
        self.prefix_hits += 1
        self.hits += len(kept[best])
        self._prefixes.move_to_end(head)
        kept.move_to_end(best)
        return best, kept[best]

    def _remember(self, head: bytes, prefix: bytes, arrays: tuple[np.ndarray, ...]) -> None:
        """Keep ``prefix`` (this body through its last segment) for the session's next
        body. The prefix it extended stays too (the next body may branch from there) until
        it is the least recently used of its head's."""
        kept = self._prefixes.setdefault(head, OrderedDict())
        self._prefixes.move_to_end(head)
        if prefix not in kept:
            self._prefix_bytes += len(prefix)
        kept[prefix] = arrays
        kept.move_to_end(prefix)
        if len(kept) > PREFIXES_PER_HEAD:
            self._prefix_bytes -= len(kept.popitem(last=False)[0])
        while self.nbytes > self.max_bytes and self._prefixes:
            old_head, old = next(iter(self._prefixes.items()))
            if len(old) <= 1:
                del self._prefixes[old_head]
            if old:
                self._prefix_bytes -= len(old.popitem(last=False)[0])

    def _segment(self, text: bytes) -> np.ndarray | None:
        arr = self._arrays.get(text)
        if arr is not None:
            self.hits += 1
            self._arrays.move_to_end(text)
            return arr
        self.misses += 1
        try:
            ids = orjson.loads(text)
        except orjson.JSONDecodeError:
            return None
        # Exactly int (orjson reads "1.0" as a float, 2**64 as a float too); in range.
        if set(map(type, ids)) != {int}:
            return None
        try:
            arr = np.asarray(ids, np.int32)
        except OverflowError:
            return None
        if arr.view(np.uint32).max() >= self.end:  # negative ids are huge as uint32
            return None
        arr.flags.writeable = False  # shared by every request that sends this segment
        self._arrays[text] = arr
        self._bytes += len(text) + arr.nbytes
        while self.nbytes > self.max_bytes and len(self._arrays) > 1:
            old_text, old = self._arrays.popitem(last=False)
            self._bytes -= len(old_text) + old.nbytes
        return arr
