"""Sets of token indices as sorted, disjoint half-open ranges: what the radix tree's
dead-KV test compares (the tokens a repos node holds, those every path below a node drops)
without a Python object per token."""

from __future__ import annotations

from collections.abc import Sequence

Ranges = list[tuple[int, int]]  # sorted, disjoint half-open token ranges

ALL: Ranges = [(0, 1 << 62)]  # every token


def ranges_of_ids(ids: Sequence[int]) -> Ranges:
    """Sorted distinct ids -> ranges."""
    out: Ranges = []
    for t in ids:
        if out and out[-1][1] == t:
            out[-1] = (out[-1][0], t + 1)
        else:
            out.append((t, t + 1))
    return out


def ranges_of_pairs(pairs: Sequence[tuple[int, int]]) -> Ranges:
    return union([], [(int(a), int(b)) for a, b in pairs if b > a])


def union(a: Ranges, b: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(a + b):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def intersect(a: Ranges, b: Ranges) -> Ranges:
    out: Ranges = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def contains(outer: Ranges, inner: Ranges) -> bool:
    """Every range of ``inner`` lies inside one range of ``outer`` (both normalised)."""
    j = 0
    for lo, hi in inner:
        while j < len(outer) and outer[j][1] < hi:
            j += 1
        if j == len(outer) or outer[j][0] > lo:
            return False
    return True
