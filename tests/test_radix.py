"""The op-aware radix tree against a brute-force model of sharing.

The model stores every inserted key sequence in a list; the longest shareable prefix of a
query is its longest common prefix (LCP) with any stored sequence. With pages of one token the
tree must match exactly that. With larger pages a token node is split only at a page boundary
counted from its own start, so a match that ends strictly inside a stored token run may be cut
back, by fewer than ``page_size`` tokens; anywhere else it must be exact.
"""

import random

import pytest
from radix_support import insert

from akv_jax.serving.page_pool import PagePool
from akv_jax.serving.radix import RadixTree

OPS = [("repos",), ("drop", ((0, 2),)), ("drop", ((1, 3), (5, 6)))]


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


def brute_dead(tree: RadixTree) -> set[int]:
    """Dead by definition: on every root-to-leaf path through a node, some later node drops
    all of its tokens (a union of drops along the way) or repositions."""
    leaves_paths: list[list] = []
    stack = [(tree.root, [])]
    while stack:
        n, path = stack.pop()
        kids = [c for g in n.children.values() for c in g]
        if not kids and path:
            leaves_paths.append(path)
        stack.extend((c, path + [c]) for c in kids)
    dead = set()
    for n in tree.nodes():
        if n.kind not in ("tokens", "repos"):
            continue
        held = set(n.token_ids())
        ok = True
        for path in leaves_paths:
            if n not in path:
                continue
            dropped: set[int] = set()
            covered = False
            for m in path[path.index(n) + 1 :]:
                if m.kind == "repos":
                    covered = True
                    break
                if m.kind == "drop":
                    dropped |= {t for a, b in m.key[0][1] for t in range(a, b)}
                    if held <= dropped:
                        covered = True
                        break
            ok &= covered
        if ok:
            dead.add(n.id)
    return dead


def agent_keys(rng: random.Random, turns: int) -> list:
    """A rolling-drop agent's keys: segments, each later dropping an older one, some repos."""
    keys: list = []
    starts: list[tuple[int, int]] = []
    tok = 0
    for _ in range(turns):
        n = rng.randint(1, 6)
        keys += [rng.randint(0, 3) for _ in range(n)]
        starts.append((tok, tok + n))
        tok += n
        r = rng.random()
        if r < 0.4 and len(starts) > 2:
            keys.append(("drop", tuple(rng.sample(starts[:-1], rng.randint(1, 2)))))
        elif r < 0.5:
            keys.append(("repos",))
    return keys


@pytest.mark.parametrize("seed", range(4))
def test_dead_equals_brute_force(seed):
    rng = random.Random(seed)
    tree = RadixTree(PagePool(100_000), 1)
    stored: list[list] = []
    seen_dead = 0
    for _ in range(40):
        if stored and rng.random() < 0.6:  # continue or branch off a stored history
            base = rng.choice(stored)
            keys = base[: rng.randint(1, len(base))] + agent_keys(rng, rng.randint(1, 4))
        else:
            keys = agent_keys(rng, rng.randint(2, 8))
        insert(tree, keys)
        stored.append(keys)
        dead = tree.dead()
        assert dead == brute_dead(tree)
        seen_dead += len(dead)
    assert seen_dead > 0


def test_rolling_drop_kv_is_dead_and_goes_first_even_when_locked():
    ps = 2
    pool = PagePool(64)
    tree = RadixTree(pool, ps)
    # turn 1: tool (0..3) + reasoning (4..5); turn 2 drops the tool 2 segments later
    insert(tree, [1, 2, 3, 4])  # turn 1 (the engine makes a node per segment)
    a = insert(tree, [1, 2, 3, 4, 5, 6, 7, 8, ("drop", ((0, 4),)), 9, 9])
    tool, reasoning, later = a[0], a[1], a[-1]
    assert tree.dead() == {tool.id}
    # a running request holds the path; another trajectory is idle and older
    b = insert(tree, [5, 5, 5, 5])
    for n in b:
        n.last_used -= 10
    tree.lock(later)
    freed = tree.evict(1)
    assert freed == 2 and tool.pages is None  # dead KV first, despite the lock
    assert reasoning.pages is not None and b[0].pages is not None
    assert tree.dead_evictions == 2
    # then LRU among unlocked nodes: the idle trajectory; the locked live path stays
    tree.evict(100)
    assert b[0].pages is None and reasoning.pages is not None and later.pages is not None
    # a branch that keeps the tool visible makes it live again
    insert(tree, [1, 2, 3, 4, 5, 6, 7, 8, 3, 3])
    assert tool.id not in tree.dead()
    tree.unlock(later)
    tree.flush()
    assert pool.used_pages == 0


def test_pinned_nodes_are_kept_and_match_does_not_refresh():
    pool = PagePool(8)
    tree = RadixTree(pool, 1)
    insert(tree, [1])
    a = insert(tree, [1, 2, ("drop", ((0, 1),)), 3])
    old = a[0].last_used
    tree.match([1, 2, ("drop", ((0, 1),)), 3])
    assert a[0].last_used == old  # passing over KV is not using it
    tree.pinned.add(a[0].id)
    assert tree.evict(1) == 1 and a[0].pages is not None  # the pinned dead node stays
    tree.pinned.clear()
    tree.evict(1)
    assert a[0].pages is None


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
    assert tree.dead() == {a[0].id}
    freed = tree.evict(1)
    assert freed == 3 and a[0].pages is None  # dropped KV went first
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


@pytest.mark.parametrize("seed", range(30))
def test_request_keys_equal_a_token_by_token_flattening(seed):
    """RequestKeys.of visits only the boundaries with ops; its keys must equal the naive
    statement: every segment's tokens, then its drops as absolute token ranges, then its
    repos, and its runs must merge exactly the segments between ops."""
    from akv_jax.cache.ops import parse_history
    from akv_jax.serving.radix_keys import Op, RequestKeys, Run

    rng = random.Random(seed)
    n = rng.randint(1, 12)
    segments = [[rng.randrange(50) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    drops: dict[str, list[int]] = {}
    dropped: set[int] = set()
    for b in range(n):
        can = [i for i in range(1, b + 1) if i not in dropped]
        if can and rng.random() < 0.3:
            pick = sorted(rng.sample(can, rng.randint(1, min(3, len(can)))))
            drops[str(b)] = pick
            dropped |= set(pick)
    repos = sorted(rng.sample(range(n), rng.randint(0, min(3, n))))
    history = parse_history({"drop": drops, "reposition": repos}, n)
    starts = [0]
    for seg in segments:
        starts.append(starts[-1] + len(seg))
    naive: list = []
    for s, seg in enumerate(segments):
        naive.extend(seg)
        if history.drops_at(s):
            naive.append(("drop", tuple((starts[i], starts[i + 1]) for i in history.drops_at(s))))
        if history.repos_at(s):
            naive.append(("repos",))
    keys = RequestKeys.of(segments, history)
    assert keys.flat() == naive
    runs = [p for p in keys.parts if isinstance(p, Run)]
    assert all(r.end > r.start for r in runs)
    # Adjacent runs are merged.
    assert all(not (isinstance(a, Run) and isinstance(b, Run))
               for a, b in zip(keys.parts, keys.parts[1:], strict=False))
    assert [p.boundary for p in keys.parts if isinstance(p, Op)] == sorted(
        p.boundary for p in keys.parts if isinstance(p, Op))
