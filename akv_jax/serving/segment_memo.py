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


class SegmentMemo:
    """Validated segments of /generate bodies by their JSON text, least recently used
    first out past ``max_bytes`` (texts and arrays together). One thread uses it (the
    event loop's)."""

    def __init__(self, vocab_size: int | None, max_bytes: int = 64 << 20):
        self.end = _INT32_END if vocab_size is None else min(vocab_size, _INT32_END)
        self.max_bytes = max_bytes
        self._arrays: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def nbytes(self) -> int:
        """Bytes held: segment texts and their arrays."""
        return self._bytes

    def split(self, raw: bytes) -> tuple[bytes, list[np.ndarray]] | None:
        """``raw`` as (the body with ``input_ids`` emptied, ``[]``, for the caller to parse;
        the segments as int32 arrays), or None when the fast path does not apply (see the
        module docstring)."""
        head = _HEAD.match(raw)
        if head is None:
            return None
        start = head.end()  # just past the "[" that opens input_ids
        b = np.frombuffer(raw, np.uint8)[start:]
        brackets = np.flatnonzero((b == ord("[")) | (b == ord("]")))
        # A list of flat lists: "[" and "]" alternate until the "]" that closes input_ids
        # stands where a "[" would come (a "[" where a "]" would is nesting: not ours).
        off = np.flatnonzero((b[brackets] == ord("[")) != (np.arange(len(brackets)) % 2 == 0))
        if not len(off) or off[0] % 2 or off[0] == 0:
            return None
        n = int(off[0]) // 2
        end = int(brackets[2 * n])  # the "]" that closes input_ids
        if raw[start : start + end].translate(None, _ID_BYTES):
            return None  # something besides digits, commas, brackets and white space
        opens = (brackets[0 : 2 * n : 2] + start).tolist()
        closes = (brackets[1 : 2 * n : 2] + start + 1).tolist()
        # Between segments exactly one comma (and white space); none before or after.
        gaps = [raw[start : opens[0]], raw[closes[-1] : start + end]]
        gaps += [raw[c:o] for c, o in zip(closes[:-1], opens[1:], strict=True)]
        if gaps[0].strip(_WHITE) or gaps[1].strip(_WHITE):
            return None
        if any(g.strip(_WHITE) != b"," for g in gaps[2:]):
            return None
        segments = []
        for a, z in zip(opens, closes, strict=True):
            arr = self._segment(raw[a:z])
            if arr is None:
                return None
            segments.append(arr)
        return raw[:start] + b"]" + raw[start + end + 1 :], segments

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
        while self._bytes > self.max_bytes and len(self._arrays) > 1:
            old_text, old = self._arrays.popitem(last=False)
            self._bytes -= len(old_text) + old.nbytes
        return arr
