"""The KV cache as the scheduler and planner see it: the op-aware radix tree and the page
pool behind match / lock / alloc / insert / evict / flush.

This is the only code that writes node fields (pages, writer, locks, clocks, pins); the
planner decides *what* a request needs and asks for it here, the scheduler says when a
request starts, finishes or fails. Eviction policy lives in the tree (radix.py); page
ownership in the pool (page_pool.py).

The host tier. With ``host_pages`` > 0, live KV that eviction takes off the device is first
copied to a bounded pool of host pages (``spill``; the copy itself is the executor's, given
as ``mover``), and a request that needs it again reloads it (``reload``: a copy, no
compute) instead of recomputing it. Dead KV is never spilled. The host pool evicts by the
same rule as the device (dead first, then least recently used); what it evicts is gone and
is recomputed when needed, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from akv_jax.serving.page_pool import PagePool
from akv_jax.serving.radix import Node, RadixTree
from akv_jax.serving.radix_keys import Key, RequestKeys


class PageMover(Protocol):
    """Copies KV pages between the device pool and the host tier (the executor)."""

    def offload(self, device_pages: list[int], host_pages: list[int]) -> None: ...

    def reload(self, host_pages: list[int], device_pages: list[int]) -> None: ...


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, host_pages: int = 0,
                 mover: PageMover | None = None):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_host_pages = host_pages if mover is not None else 0
        self.mover = mover
        self.pool = PagePool(num_pages)
        self.host_pool = PagePool(self.num_host_pages) if self.num_host_pages else None
        self.tree = RadixTree(self.pool, page_size)
        self._connect_tiers()
        self.tier_counters = dict(offloaded_pages=0, reloaded_pages=0, host_evicted_pages=0,
                                  host_dead_evictions=0)
        # What the plan in progress changed, so that a plan that gives up or raises
        # anywhere is undone exactly (see begin_plan / undo_plan).
        self._journal: list[tuple[str, Node]] | None = None

    def _connect_tiers(self) -> None:
        self.tree.spill = self.spill if self.host_pool is not None else None

    # ------------------------------------------------------------------ reads
    def match(self, keys: RequestKeys | Sequence[Key]) -> list[Node]:
        """The longest stored prefix of ``keys``, as nodes (the last may have been split)."""
        return self.tree.match(keys)

    @staticmethod
    def path_to(node: Node) -> list[Node]:
        return RadixTree.path_to(node)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def node_pages(self, node: Node) -> int:
        """Pages ``node`` holds when resident (token runs start on a fresh page)."""
        return node.num_pages(self.page_size)

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

    def add(self, parent: Node, key: Sequence[Key], kind: str, tok_start: int = 0,
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

    def alloc_nodes(self, nodes: Sequence[Node], keep_used_after: float | None = None) -> bool:
        """Pages for every node in ``nodes``, or for none (False). ``keep_used_after``:
        evict no live KV used since then that would be lost (see RadixTree.evict)."""
        sizes = [self.node_pages(node) for node in nodes]
        # One eviction for the whole plan: each one sorts every node of the tree.
        short = sum(sizes) - self.pool.free_pages
        if short > 0 and self.tree.evict(short, keep_used_after, all_or_nothing=True) < short:
            return False
        for node, n in zip(nodes, sizes, strict=True):
            node.pages = self.pool.alloc(n)
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

    # ------------------------------------------------------------------ host tier
    def spill(self, nodes: list[Node]) -> None:
        """Copy live nodes that eviction is about to empty to the host tier, as many as it
        can take (making room by evicting its own dead, then least recently used, copies;
        never those of ``nodes`` or of nodes pinned this step). One batched copy."""
        assert self.host_pool is not None and self.mover is not None
        spilling = {n.id for n in nodes}
        dev: list[int] = []
        host: list[int] = []
        for node in sorted(nodes, key=lambda n: -n.last_used):  # the most recent first
            need = len(node.pages)
            if need > self.host_pool.free_pages:
                self._evict_host(need - self.host_pool.free_pages, spilling)
            got = self.host_pool.alloc(need)
            if got is None:
                continue  # the host tier is full of what is pinned or spilling now
            node.host_pages = got
            dev += node.pages
            host += got
        if dev:
            self.mover.offload(dev, host)
            self.tier_counters["offloaded_pages"] += len(dev)

    def _evict_host(self, pages_needed: int, keep: set[int]) -> None:
        dead = self.tree.dead()
        cands = [n for n in self.tree.nodes()
                 if n.host_pages and n.id not in keep and n.id not in self.tree.pinned]
        cands.sort(key=lambda n: (n.id not in dead, n.last_used))
        freed = 0
        for n in cands:
            if freed >= pages_needed:
                break
            freed += len(n.host_pages)
            if n.id in dead:
                self.tier_counters["host_dead_evictions"] += len(n.host_pages)
            self.host_pool.free(n.host_pages)
            n.host_pages = None
        self.tier_counters["host_evicted_pages"] += freed

    def reload(self, nodes: Sequence[Node]) -> None:
        """Copy host-tier KV back into the device pages just allocated for ``nodes``."""
        nodes = [n for n in nodes if n.pages is not None and n.host_pages is not None]
        if not nodes:
            return
        host = [pg for n in nodes for pg in n.host_pages]
        dev = [pg for n in nodes for pg in n.pages]
        self.mover.reload(host, dev)
        self.tier_counters["reloaded_pages"] += len(dev)

    @property
    def host_used_pages(self) -> int:
        return self.host_pool.used_pages if self.host_pool is not None else 0

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
        """Drop every stored node, in both tiers (callers ensure nothing is locked)."""
        if self.host_pool is not None:
            for n in self.tree.nodes():
                if n.host_pages:
                    self.host_pool.free(n.host_pages)
                    n.host_pages = None
        self.tree.flush()

    def reset(self) -> None:
        """Start over from empty pools and tree (after a fault that left the bookkeeping
        untrustworthy); eviction counters carry on."""
        old = self.tree
        self.pool = PagePool(self.num_pages)
        self.host_pool = PagePool(self.num_host_pages) if self.num_host_pages else None
        self.tree = RadixTree(self.pool, self.page_size)
        self.tree.evictions, self.tree.dead_evictions = old.evictions, old.dead_evictions
        self._connect_tiers()

    def stats(self) -> dict[str, int]:
        return dict(
            evictions=self.tree.evictions,
            dead_evictions=self.tree.dead_evictions,
            pool_used_pages=self.pool.used_pages,
            pool_total_pages=self.num_pages,
            host_used_pages=self.host_used_pages,
            host_total_pages=self.num_host_pages,
            **self.tier_counters,
        )
