"""The op-aware radix tree against a brute-force model of sharing.

The model stores every inserted key sequence in a list; the longest shareable prefix of a
query is its longest common prefix (LCP) with any stored sequence. With pages of one token the
tree must match exactly that. With larger pages a token node is split only at a page boundary
counted from its own start, so a match that ends strictly inside a stored token run may be cut
back, by fewer than ``page_size`` tokens; anywhere else it must be exact.
"""

import random

import pytest

from akv_jax.serving.page_pool import PagePool
from akv_jax.serving.radix import RadixTree

OPS = [("repos",), ("drop", ((0, 2),)), ("drop", ((1, 3), (5, 6)))]


def insert(tree: RadixTree, keys: list) -> list:
    """Insert like the engine: match, then one node per token run / op, pages allocated."""
    path = tree.match(keys)
    i = sum(len(n.key) for n in path)
    parent = path[-1] if path else tree.root
    while i < len(keys):
        if isinstance(keys[i], int):
            j = i
            while j < len(keys) and isinstance(keys[j], int):
                j += 1
            node = tree.add_child(parent, tuple(keys[i:j]), "tokens", i)
            node.pages = tree.alloc(-(-(j - i) // tree.page_size))
            assert node.pages is not None
            i = j
        else:
            node = tree.add_child(parent, (keys[i],), keys[i][0])
            i += 1
        path.append(node)
        parent = node
    return path


def brute_match(stored: list[list], keys: list) -> tuple[int, bool]:
    """(LCP with any stored sequence, whether it ends strictly inside a stored token run)."""
    best, inside = 0, False
    for seq in stored:
        n = 0
        while n < min(len(seq), len(keys)) and seq[n] == keys[n]:
            n += 1
        in_run = 0 < n < len(seq) and isinstance(seq[n], int) and isinstance(seq[n - 1], int)
        if n > best or (n == best and not in_run):
            best, inside = n, in_run
    return best, inside


def random_keys(rng: random.Random, base: list | None) -> list:
    keys = list(base[: rng.randint(0, len(base))]) if base else []
    for _ in range(rng.randint(1, 4)):
        keys += [rng.randint(0, 5) for _ in range(rng.randint(1, 9))]
        if rng.random() < 0.5:
            keys.append(rng.choice(OPS))
    return keys


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_equals_brute_force(page_size):
    rng = random.Random(page_size)
    tree = RadixTree(PagePool(100_000), page_size)
    stored: list[list] = []
    for step in range(400):
        base = rng.choice(stored) if stored and rng.random() < 0.7 else None
        keys = random_keys(rng, base)
        lcp, inside = brute_match(stored, keys)
        path = tree.match(keys)
        got = sum(len(n.key) for n in path)
        if inside:
            assert lcp - page_size < got <= lcp, (step, keys)
        else:
            assert got == lcp, (step, keys)
        # the path spells exactly the matched prefix
        spelled = [k for n in path for k in (n.key if n.kind == "tokens" else n.key[:1])]
        assert spelled == keys[:got]
        if rng.random() < 0.6:
            insert(tree, keys)
            stored.append(keys)
        if rng.random() < 0.1:  # evictions empty nodes but never change what matches
            tree.evict(rng.randint(1, 50))


def test_eviction_order_locks_and_flush():
    ps = 2
    pool = PagePool(64)
    tree = RadixTree(pool, ps)
    # path A: tokens 0..5 (3 pages), then a drop of all of them, then tokens (2 pages)
    a = insert(tree, [1, 2, 3, 4, 5, 6, ("drop", ((0, 6),)), 7, 8, 9])
    # path B: unrelated tokens (2 pages), locked as if a request ran on it
    b = insert(tree, [9, 9, 9, 9])
    tree.lock(b[-1])
    used = pool.used_pages
    assert RadixTree.dropped_only(a[0]) and not RadixTree.dropped_only(a[-1])
    freed = tree.evict(1)
    assert freed == 3 and a[0].pages is None  # dropped-only KV went first
    assert a[-1].pages is not None and b[0].pages is not None
    # emptied nodes stay: the full path still matches
    assert [n.id for n in tree.match([1, 2, 3, 4, 5, 6, ("drop", ((0, 6),)), 7, 8, 9])] == [
        n.id for n in a
    ]
    tree.evict(100)  # everything unlocked goes; the locked path stays
    assert b[0].pages is not None and a[-1].pages is None
    assert pool.used_pages == len(b[0].pages) < used
    tree.unlock(b[-1])
    tree.flush()
    assert pool.used_pages == 0


def test_split_keeps_locks_balanced():
    tree = RadixTree(PagePool(64), 2)
    (node,) = insert(tree, [1, 2, 3, 4, 5, 6])
    tree.lock(node)
    path = tree.match([1, 2, 3, 4, 9])  # splits at 4 (page boundary)
    assert [len(n.key) for n in path] == [4] and path[0].lock == 1
    tree.unlock(node)  # the original (now lower) node walks up through the new upper part
    assert path[0].lock == 0 and node.lock == 0
