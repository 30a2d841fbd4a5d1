"""Op-aware radix tree over token ids *and* cache operations.

A request's key (radix_keys.py) is its history flattened into token ids and op items. Two
requests share a node only on a common prefix of tokens **and** ops, which is exactly when
they have the same cache state there (DESIGN.md §2).

Nodes:
* token nodes: a run of token ids and the pages holding their K/V, as computed at their
  append positions. Token runs start on a fresh page, so a node can be split only at a
  page boundary; a match that diverges mid-page is cut back to the page start.
* drop nodes: no KV; visibility changes are derived from the op items.
* repos nodes: a new *position version*: compact copies (K re-rotated, V copied) of every
  token still active there, in their own pages. Other requests keep the old version.

Running requests *lock* the nodes on their path. Eviction empties a node (frees its device
pages) but keeps it in the tree, so descendants stay findable. A node's KV lives in up to two
tiers: device pages (``pages``) and host pages (``host_pages``, the host tier of
cache_manager.py, which eviction spills live KV to); a later request that needs a node with
neither recomputes it in its one-pass prefill, one with a host copy reloads it (a copy). A
node's KV never changes once written, so a host copy stays valid while the node lives.

Drop-aware eviction. A node's KV is *dead* when every stored path below it drops all of its
tokens, or repositions (a repos node holds its own compact copy), before reaching its leaf:
nothing continuing a stored path attends to it again. Dead KV goes first, and may be freed
even under a running request's lock (that request's final view does not see it either);
then the rest by least recent *use*: a node's clock is refreshed when a request reads or
writes its KV, not when a request merely passes over it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from akv_jax.serving import token_ranges
from akv_jax.serving.page_pool import PagePool
from akv_jax.serving.radix_keys import Key, Op, RequestKeys
from akv_jax.serving.token_ranges import Ranges

_ids = itertools.count()


class Node:
    __slots__ = (
        "id",
        "key",
        "kind",
        "parent",
        "children",
        "pages",
        "host_pages",
        "lock",
        "last_used",
        "tok_start",
        "held_tokens",
        "busy_step",
        "writer",
        "ends",
        "_held_ranges",
        "_held_array",
        "_slot_tokens",
        "_slot_valid",
        "_page_list",
        "_page_array",
    )

    def __init__(self, key: tuple | np.ndarray, kind: str, parent: Node | None,
                 tok_start: int = 0):
        self.id = next(_ids)
        self.key = key  # token ids (tokens: an int32 array) or a 1-tuple holding the op item
        self.kind = kind  # "root" | "tokens" | "drop" | "repos"
        self.parent = parent
        self.children: dict[Key, list[Node]] = {}
        self.pages: list[int] | None = None  # device pages holding its KV (None: not resident)
        self.host_pages: list[int] | None = None  # host-tier pages holding a copy
        self.lock = 0
        self.last_used = time.monotonic()
        self.tok_start = tok_start  # absolute index of the first token (token nodes)
        self.held_tokens: tuple[int, ...] = ()  # absolute token ids a repos node holds
        self.busy_step = -1  # the scheduler step whose forward writes this node's KV
        self.writer: str | None = None  # request whose prefill, still running, writes it
        self.ends = 0  # running requests whose path ends here (their state is this node)
        self._held_ranges: Ranges | None = None
        self._held_array: np.ndarray | None = None
        self._slot_tokens: np.ndarray | None = None
        self._slot_valid: np.ndarray | None = None
        self._page_list: list[int] | None = None
        self._page_array: np.ndarray | None = None

    @property
    def evicted(self) -> bool:
        """Holds KV but none of it is on the device (it may be on the host)."""
        return self.kind in ("tokens", "repos") and self.pages is None

    @property
    def gone(self) -> bool:
        """Holds KV that no tier has: it must be recomputed to be read."""
        return self.evicted and self.host_pages is None

    @property
    def first(self) -> Key:
        """The key its parent's ``children`` files it under: its first token or its op."""
        return int(self.key[0]) if self.kind == "tokens" else self.key[0]

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV it holds."""
        if self.kind == "tokens":
            return len(self.key)
        return len(self.held_tokens)

    def token_ids(self) -> tuple[int, ...]:
        """Absolute indices of the tokens whose KV this node holds."""
        if self.kind == "tokens":
            return tuple(range(self.tok_start, self.tok_start + len(self.key)))
        return self.held_tokens

    def token_array(self) -> np.ndarray:
        """``token_ids()`` as an int64 array (a repos node's cached: planning reads every
        node's tokens once per plan, and a 30K-token history as Python ints costs
        milliseconds per node)."""
        if self.kind == "tokens":
            return np.arange(self.tok_start, self.tok_start + len(self.key), dtype=np.int64)
        if self._held_array is None:
            self._held_array = np.asarray(self.held_tokens, np.int64)
        return self._held_array

    def slot_tokens(self, page_size: int) -> np.ndarray:
        """The token held in each slot of its pages (-1: padding after the last), cached:
        a plan lays out every node of a view, and its tokens change only by a split."""
        if self._slot_tokens is None:
            toks = self.token_array()
            out = np.full(-(-len(toks) // page_size) * page_size, -1, np.int64)
            out[: len(toks)] = toks
            self._slot_tokens = out
        return self._slot_tokens

    def page_array(self) -> np.ndarray:
        """``pages`` as an int32 array, cached while ``pages`` is the same list (every change
        of a node's pages assigns a new one); empty while the node is not resident."""
        if self._page_list is not self.pages or self._page_array is None:
            self._page_list = self.pages
            self._page_array = (np.asarray(self.pages, np.int32) if self.pages is not None
                                else np.zeros(0, np.int32))
        return self._page_array

    def num_pages(self, page_size: int) -> int:
        """Pages it holds when resident (token runs start on a fresh page)."""
        return -(-self.num_tokens // page_size)

    def slot_valid(self, page_size: int) -> np.ndarray:
        """Which slots of its pages hold a token (the rest pad the last page), cached."""
        if self._slot_valid is None:
            self._slot_valid = self.slot_tokens(page_size) >= 0
        return self._slot_valid

    def held_ranges(self) -> Ranges:
        """``token_ids()`` as ranges (cached: a node's held tokens change only by a split)."""
        if self._held_ranges is None:
            if self.kind == "tokens":
                self._held_ranges = [(self.tok_start, self.tok_start + len(self.key))]
            else:
                self._held_ranges = token_ranges.ranges_of_ids(self.held_tokens)
        return self._held_ranges

    def __repr__(self) -> str:
        body = f"{len(self.key)} tok" if self.kind == "tokens" else repr(self.key[0])
        return (f"Node#{self.id}({self.kind}, {body}, pages={self.pages}, "
                f"host={self.host_pages}, lock={self.lock})")


class RadixTree:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size
        self.root = Node((), "root", None)
        self.evictions = 0  # pages freed by eviction
        self.dead_evictions = 0  # of which dead KV
        # Called with the live (not dead) nodes an eviction is about to empty, while their
        # pages still hold their KV: the host tier copies what it can (cache_manager.py).
        self.spill: Callable[[list[Node]], None] | None = None
        self.pinned: set[int] = set()  # node ids the current step reads or writes: kept
        self._shape_version = 0  # bumped by every structural change
        self._dead_cache: tuple[int, set[int]] = (-1, set())

    # ------------------------------------------------------------------ matching
    def match(self, keys: RequestKeys | Sequence[Key]) -> list[Node]:
        """Longest stored prefix of ``keys``: the node path (root excluded).

        Token nodes matched partially are split at the last page boundary inside the match,
        so every returned node is matched whole (and nothing after a split can match).
        Emptied nodes are matched like any other.
        """
        if not isinstance(keys, RequestKeys):
            keys = RequestKeys.from_flat(keys)
        path: list[Node] = []
        node, toks = self.root, keys.tokens
        for part in keys.parts:
            if isinstance(part, Op):
                node = next((c for c in node.children.get(part.item, ())
                             if c.kind != "tokens"), None)
                if node is None:
                    return path
                path.append(node)
                continue
            i = part.start
            while i < part.end:
                best, best_len = None, 0
                for child in node.children.get(int(toks[i]), ()):
                    if child.kind != "tokens":
                        continue
                    n = _common_prefix(child.key, toks, i, part.end)
                    if n < len(child.key):
                        n = (n // self.page_size) * self.page_size
                    if n > best_len:
                        best, best_len = child, n
                if best is None:
                    return path
                if best_len < len(best.key):
                    path.append(self.split(best, best_len))
                    return path
                path.append(best)
                i += best_len
                node = best
        return path

    @staticmethod
    def touch(nodes: Iterator[Node] | Sequence[Node]) -> None:
        """Refresh the LRU clock of nodes whose KV is being used."""
        now = time.monotonic()
        for n in nodes:
            n.last_used = now

    def split(self, node: Node, n: int) -> Node:
        """Split token node at ``n`` (a page multiple): returns the new upper part."""
        assert n % self.page_size == 0 and 0 < n < len(node.key)
        self._shape_version += 1
        upper = Node(node.key[:n], "tokens", node.parent, node.tok_start)
        upper.lock = node.lock
        upper.last_used = node.last_used
        upper.busy_step = node.busy_step
        upper.writer = node.writer
        if node.pages is not None:
            upper.pages = node.pages[: n // self.page_size]
            node.pages = node.pages[n // self.page_size :]
        if node.host_pages is not None:
            upper.host_pages = node.host_pages[: n // self.page_size]
            node.host_pages = node.host_pages[n // self.page_size :]
        siblings = node.parent.children[node.first]
        siblings[siblings.index(node)] = upper
        node.key = node.key[n:]
        node.tok_start += n
        node._held_ranges = node._slot_tokens = node._slot_valid = None
        node.parent = upper
        upper.children = {node.first: [node]}
        return upper

    # ------------------------------------------------------------------ insertion
    def add_child(self, parent: Node, key: Sequence[Key] | np.ndarray, kind: str,
                  tok_start: int = 0) -> Node:
        """A fresh child: ``key`` holds token ids (kind "tokens") or the op item."""
        self._shape_version += 1
        if kind == "tokens":
            key = np.array(key, np.int32)
        child = Node(key, kind, parent, tok_start)
        parent.children.setdefault(child.first, []).append(child)
        return child

    def remove(self, node: Node) -> None:
        """Detach a childless, page-less node (a plan that was abandoned)."""
        assert not node.children and node.pages is None
        self._shape_version += 1
        group = node.parent.children[node.first]
        group.remove(node)
        if not group:
            del node.parent.children[node.first]

    # ------------------------------------------------------------------ locking
    # A lock is taken on the deepest node and walks up to the root, so a later split (which
    # inserts an upper node carrying the same count) keeps every count balanced. The deepest
    # node also counts as a path end: a running request's state is a stored path of its own
    # even where longer requests continue below it (see dead()).
    def lock(self, node: Node) -> None:
        node.ends += 1
        self._shape_version += 1
        while node is not None and node.kind != "root":
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        node.ends -= 1
        assert node.ends >= 0, node
        self._shape_version += 1
        while node is not None and node.kind != "root":
            node.lock -= 1
            assert node.lock >= 0, node
            node = node.parent

    @staticmethod
    def path_to(node: Node) -> list[Node]:
        """Nodes from the root (excluded) down to ``node``."""
        out = []
        while node is not None and node.kind != "root":
            out.append(node)
            node = node.parent
        return out[::-1]

    # ------------------------------------------------------------------ eviction
    def nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            for group in n.children.values():
                stack.extend(group)

    def dead(self) -> set[int]:
        """Ids of nodes whose KV no stored path below them attends to again (cached per
        tree shape and lock set). One post-order pass: ``covered[n]`` is the set of tokens
        every path from ``n`` down to a leaf drops (a repos covers everything; a leaf, and a
        node where a running request's path ends, nothing: that request still attends to
        its whole final view, whatever longer requests below it drop)."""
        version, cached = self._dead_cache
        if version == self._shape_version:
            return cached
        covered: dict[int, Ranges] = {}
        dead: set[int] = set()
        for n in reversed(list(self.nodes())):  # nodes() is pre-order: children come first
            below: Ranges | None = None
            for group in n.children.values():
                for c in group:
                    if c.kind == "repos":
                        through = token_ranges.ALL
                    elif c.kind == "drop":
                        dropped = token_ranges.ranges_of_pairs(c.key[0][1])
                        through = token_ranges.union(dropped, covered[c.id])
                    else:
                        through = covered[c.id]
                    below = through if below is None else token_ranges.intersect(below, through)
            covered[n.id] = [] if n.ends else below or []
            holds_kv = n.kind in ("tokens", "repos")
            if holds_kv and token_ranges.contains(covered[n.id], n.held_ranges()):
                dead.add(n.id)
        self._dead_cache = (self._shape_version, dead)
        return dead

    def evict(self, pages_needed: int, keep_used_after: float | None = None,
              all_or_nothing: bool = False) -> int:
        """Free at least ``pages_needed`` device pages if possible; returns pages freed.

        Order: dead KV first (see the module docstring; also under a lock), then unlocked
        KV by least recent use. Nodes the current step reads or writes are never touched;
        with ``keep_used_after``, neither is live KV used since then that would be lost (no
        host copy and no spill hook to make one): admission's protection of trajectories
        that are still active. ``all_or_nothing``: free nothing unless ``pages_needed``
        can be (an allocation that would fail anyway keeps the cache)."""
        dead = self.dead()

        def evictable(n: Node) -> bool:
            if not n.pages or n.id in self.pinned:
                return False
            if n.id in dead:
                return True
            if n.lock:
                return False
            return (keep_used_after is None or n.last_used <= keep_used_after
                    or n.host_pages is not None or self.spill is not None)

        cands = sorted((n for n in self.nodes() if evictable(n)),
                       key=lambda n: (n.id not in dead, n.last_used))
        chosen, freed = [], 0
        for n in cands:
            if freed >= pages_needed:
                break
            chosen.append(n)
            freed += len(n.pages)
        if all_or_nothing and freed < pages_needed:
            return 0
        live = [n for n in chosen if n.id not in dead and n.host_pages is None]
        if live and self.spill is not None:
            self.spill(live)
        for n in chosen:
            if n.id in dead:
                self.dead_evictions += len(n.pages)
            self.pool.free(n.pages)
            n.pages = None
        self.evictions += freed
        return freed

    def alloc(self, n: int, keep_used_after: float | None = None) -> list[int] | None:
        """Allocate ``n`` pages, evicting unlocked KV when the pool is short (see evict)."""
        if n > self.pool.free_pages:
            self.evict(n - self.pool.free_pages, keep_used_after, all_or_nothing=True)
        return self.pool.alloc(n)

    def flush(self) -> None:
        """Drop every node (callers ensure nothing is locked)."""
        for n in self.nodes():
            if n.pages:
                self.pool.free(n.pages)
                n.pages = None
        self.root.children = {}
        self._shape_version += 1


def _common_prefix(a: np.ndarray, toks: np.ndarray, start: int, end: int) -> int:
    """Length of the common prefix of ``a`` and ``toks[start:end]``."""
    m = min(len(a), end - start)
    # Equal bytes first: a resent history matches whole, and one memcmp beats numpy's
    # elementwise compare and reduction on runs of a message's length.
    if a[:m].tobytes() == toks[start : start + m].tobytes():
        return m
    return int((a[:m] == toks[start : start + m]).argmin())
