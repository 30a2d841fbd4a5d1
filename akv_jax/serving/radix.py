"""Op-aware radix tree over token ids *and* cache operations.

A request's key is its history flattened into items: token ids (ints) interleaved with op
items, ``("drop", ((start, end), ...))`` naming absolute token ranges and ``("repos",)``.
Two requests share a node only on a common prefix of tokens **and** ops, which is exactly
when they have the same cache state there (DESIGN.md §2).

Nodes:
* token nodes: a run of token ids and the pages holding their K/V, as computed at their
  append positions. Token runs start on a fresh page, so a node can be split only at a
  page boundary; a match that diverges mid-page is cut back to the page start.
* drop nodes: no KV; visibility changes are derived from the op items.
* repos nodes: a new *position version*: compact copies (K re-rotated, V copied) of every
  token still active there, in their own pages. Other requests keep the old version.

Running requests *lock* the nodes on their path; locked nodes are never evicted. Eviction
empties a node (frees its pages) but keeps it in the tree, so descendants stay findable;
a later request that needs an emptied node's KV recomputes it in its one-pass prefill.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from akv_jax.serving.page_pool import PagePool

Key = Any  # int token id, or an op tuple

_ids = itertools.count()


class Node:
    __slots__ = (
        "id",
        "key",
        "kind",
        "parent",
        "children",
        "pages",
        "lock",
        "last_used",
        "tok_start",
        "held_tokens",
        "busy_step",
    )

    def __init__(self, key: tuple, kind: str, parent: Node | None, tok_start: int = 0):
        self.id = next(_ids)
        self.key = key  # token ids (tokens) or a 1-tuple holding the op item
        self.kind = kind  # "root" | "tokens" | "drop" | "repos"
        self.parent = parent
        self.children: dict[Key, list[Node]] = {}
        self.pages: list[int] | None = None
        self.lock = 0
        self.last_used = time.monotonic()
        self.tok_start = tok_start  # absolute index of the first token (token nodes)
        self.held_tokens: tuple[int, ...] = ()  # absolute token ids a repos node holds
        self.busy_step = -1  # the scheduler step whose forward writes this node's KV

    @property
    def num_tokens(self) -> int:
        return len(self.key) if self.kind == "tokens" else 0

    @property
    def evicted(self) -> bool:
        return self.kind in ("tokens", "repos") and self.pages is None

    def token_ids(self) -> tuple[int, ...]:
        """Absolute indices of the tokens whose KV this node holds."""
        if self.kind == "tokens":
            return tuple(range(self.tok_start, self.tok_start + len(self.key)))
        return self.held_tokens

    def __repr__(self) -> str:
        body = f"{len(self.key)} tok" if self.kind == "tokens" else repr(self.key[0])
        return f"Node#{self.id}({self.kind}, {body}, pages={self.pages}, lock={self.lock})"


class RadixTree:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool = pool
        self.page_size = page_size
        self.root = Node((), "root", None)
        self.evictions = 0  # pages freed by eviction

    # ------------------------------------------------------------------ matching
    def match(self, keys: Sequence[Key]) -> list[Node]:
        """Longest stored prefix of ``keys``: the node path (root excluded).

        Token nodes matched partially are split at the last page boundary inside the match,
        so every returned node is matched whole. Emptied nodes are matched like any other.
        """
        path: list[Node] = []
        node, i = self.root, 0
        while i < len(keys):
            best, best_len = None, 0
            for child in node.children.get(keys[i], ()):
                if child.kind == "tokens":
                    n = _common_prefix(child.key, keys, i)
                    if n < len(child.key):
                        n = (n // self.page_size) * self.page_size
                else:
                    n = 1 if child.key[0] == keys[i] else 0
                if n > best_len:
                    best, best_len = child, n
            if best is None:
                break
            if best.kind == "tokens" and best_len < len(best.key):
                best = self.split(best, best_len)
            path.append(best)
            i += len(best.key)
            node = best
        now = time.monotonic()
        for n in path:
            n.last_used = now
        return path

    def split(self, node: Node, n: int) -> Node:
        """Split token node at ``n`` (a page multiple): returns the new upper part."""
        assert n % self.page_size == 0 and 0 < n < len(node.key)
        upper = Node(node.key[:n], "tokens", node.parent, node.tok_start)
        upper.lock = node.lock
        upper.last_used = node.last_used
        upper.busy_step = node.busy_step
        if node.pages is not None:
            upper.pages = node.pages[: n // self.page_size]
            node.pages = node.pages[n // self.page_size :]
        siblings = node.parent.children[node.key[0]]
        siblings[siblings.index(node)] = upper
        node.key = node.key[n:]
        node.tok_start += n
        node.parent = upper
        upper.children = {node.key[0]: [node]}
        return upper

    # ------------------------------------------------------------------ insertion
    def add_child(self, parent: Node, key: tuple, kind: str, tok_start: int = 0) -> Node:
        child = Node(key, kind, parent, tok_start)
        parent.children.setdefault(key[0], []).append(child)
        return child

    def remove(self, node: Node) -> None:
        """Detach a childless, page-less node (a plan that was abandoned)."""
        assert not node.children and node.pages is None
        group = node.parent.children[node.key[0]]
        group.remove(node)
        if not group:
            del node.parent.children[node.key[0]]

    # ------------------------------------------------------------------ locking
    # A lock is taken on the deepest node and walks up to the root, so a later split (which
    # inserts an upper node carrying the same count) keeps every count balanced.
    @staticmethod
    def lock(node: Node) -> None:
        while node is not None and node.kind != "root":
            node.lock += 1
            node = node.parent

    @staticmethod
    def unlock(node: Node) -> None:
        now = time.monotonic()
        while node is not None and node.kind != "root":
            node.lock -= 1
            node.last_used = now
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

    @staticmethod
    def dropped_only(node: Node) -> bool:
        """No descendant can ever attend to this node's KV again: every child is a repos
        (which keeps its own copy) or a drop covering all of the node's tokens."""
        if not node.children:
            return False
        held = set(node.token_ids())
        for group in node.children.values():
            for c in group:
                if c.kind == "repos":
                    continue
                if c.kind == "drop":
                    dropped = {t for a, b in c.key[0][1] for t in range(a, b)}
                    if held <= dropped:
                        continue
                return False
        return True

    def evict(self, pages_needed: int) -> int:
        """Free at least ``pages_needed`` pages if possible; returns pages freed.

        Order: KV that only dropped histories reference goes first, then the rest by least
        recent use. Locked nodes (on a running request's path) are never touched.
        """
        cands = [n for n in self.nodes() if n.pages and n.lock == 0]
        cands.sort(key=lambda n: (0 if self.dropped_only(n) else 1, n.last_used))
        freed = 0
        for n in cands:
            if freed >= pages_needed:
                break
            freed += len(n.pages)
            self.pool.free(n.pages)
            n.pages = None
        self.evictions += freed
        return freed

    def alloc(self, n: int) -> list[int] | None:
        """Allocate ``n`` pages, evicting unlocked KV when the pool is short."""
        if n > self.pool.free_pages:
            self.evict(n - self.pool.free_pages)
        return self.pool.alloc(n)

    def flush(self) -> None:
        """Drop every node (callers ensure nothing is locked)."""
        for n in self.nodes():
            if n.pages:
                self.pool.free(n.pages)
                n.pages = None
        self.root.children = {}


def _common_prefix(a: Sequence[Key], keys: Sequence[Key], start: int) -> int:
    n = 0
    limit = min(len(a), len(keys) - start)
    while n < limit and a[n] == keys[start + n]:
        n += 1
    return n
