"""Host-side page allocator for the shared KV pool.

Pages are owned by radix-tree nodes (or, while a request decodes, by the request). Each
page has exactly one owner, so no per-page reference count is needed: sharing happens at the
node level, where running requests *lock* the nodes on their path (see radix.py).
"""

from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages = num_pages
        # Highest ids first so that pop() hands out low ids: easier to read in a debugger.
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` pages, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"page {p} freed twice")
            self._used.remove(p)
            self._free.append(p)
