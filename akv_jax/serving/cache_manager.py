"""The KV cache as the scheduler and planner see it: the op-aware radix tree and the page
pool behind match / lock / alloc / insert / evict / flush.

This is the only code that writes node fields (pages, writer, locks, clocks, pins); the
planner decides *what* a request needs and asks for it here, the scheduler says when a
request starts, finishes or fails. Eviction policy lives in the tree (radix.py); page
ownership in the pool (page_pool.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from akv_jax.serving.page_pool import PagePool
from akv_jax.serving.radix import Key, Node, RadixTree


class CacheManager:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.tree = RadixTree(self.pool, page_size)
        # What the plan in progress changed, so that a plan that gives up or raises
        # anywhere is undone exactly (see begin_plan / undo_plan).
        self._journal: list[tuple[str, Node]] | None = None

    # ------------------------------------------------------------------ reads
    def match(self, keys: Sequence[Key]) -> list[Node]:
        """The longest stored prefix of ``keys``, as nodes (the last may have been split)."""
        return self.tree.match(keys)

    @staticmethod
    def path_to(node: Node) -> list[Node]:
        return RadixTree.path_to(node)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def node_pages(self, node: Node) -> int:
        """Pages ``node`` holds when resident (token runs start on a fresh page)."""
        return self.pages_for(len(node.token_ids()))

    @property
    def used_pages(self) -> int:
        return self.pool.used_pages

    # ------------------------------------------------------------------ planning
    # A plan changes the cache in place as it goes (fresh nodes, a lock, pages, writer
    # marks); each change is journaled, so that undo_plan() reverts exactly what this plan
    # did, whichever step it stopped at. Splits are not undone: a split changes no match.
    def begin_plan(self) -> None:
        self._journal = []

    def end_plan(self) -> None:
        """The plan stands (or was undone): stop journaling."""
        self._journal = None

    def undo_plan(self) -> None:
        """Revert the plan in progress: writer marks and the pages allocated for them go
        back (nothing wrote those pages), its lock is released, its fresh nodes removed."""
        for what, node in reversed(self._journal or []):
            if what == "write":
                node.writer = None
            elif what == "alloc" and node.pages is not None:
                self.pool.free(node.pages)
                node.pages = None
            elif what == "lock":
                self.tree.unlock(node)
            elif what == "add":
                self.tree.remove(node)
        self._journal = None

    def _log(self, what: str, node: Node) -> None:
        if self._journal is not None:
            self._journal.append((what, node))

    def add(self, parent: Node, key: tuple, kind: str, tok_start: int = 0,
            held_tokens: tuple[int, ...] = ()) -> Node:
        """A fresh, empty node below ``parent`` (a repos node names the tokens it will
        hold copies of)."""
        node = self.tree.add_child(parent, key, kind, tok_start)
        node.held_tokens = held_tokens
        self._log("add", node)
        return node

    def split(self, node: Node, n: int) -> Node:
        """Split ``node`` after ``n`` keys (a page boundary); returns the upper part."""
        return self.tree.split(node, n)

    def hold(self, used: Sequence[Node], last: Node) -> None:
        """A planned request starts: the nodes its pass or final view reads are pinned for
        this step (no allocation, this request's or another's, may evict them, even dead
        KV) and their clocks refreshed; its path is locked at ``last``."""
        self.pin(used)
        self.tree.touch(used)
        self.tree.lock(last)
        self._log("lock", last)

    def pin(self, nodes: Iterable[Node]) -> None:
        self.tree.pinned.update(n.id for n in nodes)

    def new_step(self) -> None:
        """Pins last one step."""
        self.tree.pinned.clear()

    def alloc(self, n: int) -> list[int] | None:
        """``n`` pages, evicting when short; None (nothing taken) when it cannot."""
        return self.tree.alloc(n)

    def alloc_nodes(self, nodes: Sequence[Node]) -> bool:
        """Pages for every node in ``nodes``, or for none (False)."""
        done: list[Node] = []
        for node in nodes:
            pages = self.tree.alloc(self.node_pages(node))
            if pages is None:
                for n in done:
                    self.pool.free(n.pages)
                    n.pages = None
                return False
            node.pages = pages
            done.append(node)
        for node in done:
            self._log("alloc", node)
        return True

    def free(self, pages: list[int]) -> None:
        self.pool.free(pages)

    def mark_writing(self, nodes: Iterable[Node], rid: str) -> None:
        """``rid``'s prefill writes these nodes' KV; nobody may read it until it has."""
        for n in nodes:
            n.writer = rid
            self._log("write", n)

    def mark_written(self, nodes: Iterable[Node], step: int) -> None:
        """The forward of ``step`` writes these nodes' KV: plans from the next step on may
        read it (this step's may not: their pre-pass copies run before the forward)."""
        for n in nodes:
            n.writer = None
            n.busy_step = step

    @staticmethod
    def written_by(path: Iterable[Node], rid: str) -> list[Node]:
        """Nodes of ``path`` whose KV ``rid``'s unfinished prefill writes (split-off upper
        parts included: a split copies ``writer``)."""
        return [n for n in path if n.writer == rid]

    def unwrite(self, nodes: Iterable[Node]) -> None:
        """Nodes whose KV was never written go back to evicted (a later request recomputes
        them) and lose their writer."""
        for n in nodes:
            n.writer = None
            if n.pages is not None:
                self.pool.free(n.pages)
                n.pages = None

    # ------------------------------------------------------------------ finishing
    def insert(self, parent: Node, tokens: tuple[int, ...], tok_start: int,
               pages: list[int]) -> Node:
        """Store generated tokens' KV (already in ``pages``) as a token node below
        ``parent``: the next turn of the conversation matches it."""
        node = self.tree.add_child(parent, tokens, "tokens", tok_start)
        node.pages = pages
        return node

    def release(self, last: Node | None, view: Sequence[Node]) -> None:
        """A request ends: its final view was just read (clocks refreshed: the next turn
        attends to it again) and its path is unlocked."""
        self.tree.touch(view)
        if last is not None:
            self.tree.unlock(last)

    # ------------------------------------------------------------------ whole cache
    def flush(self) -> None:
        """Drop every stored node (callers ensure nothing is locked)."""
        self.tree.flush()

    def reset(self) -> None:
        """Start over from an empty pool and tree (after a fault that left the bookkeeping
        untrustworthy); eviction counters carry on."""
        old = self.tree
        self.pool = PagePool(self.num_pages)
        self.tree = RadixTree(self.pool, self.page_size)
        self.tree.evictions, self.tree.dead_evictions = old.evictions, old.dead_evictions

    def stats(self) -> dict[str, int]:
        return dict(
            evictions=self.tree.evictions,
            dead_evictions=self.tree.dead_evictions,
            pool_used_pages=self.pool.used_pages,
            pool_total_pages=self.num_pages,
        )
