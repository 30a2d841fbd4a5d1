"""The host tier on its own: the cache manager's bookkeeping (what is spilled, what the host
evicts, splits, flush) against a recording mover, and the byte moves (HostKV) against the
device pool they copy. End-to-end exactness with the tier is tested in test_engine_exact.py
and exactness.py (tests/test_exact_any_order*.py)."""

import jax
import numpy as np
from radix_support import insert

from akv_jax.model.forward import KVPool
from akv_jax.model.params import init_params
from akv_jax.model.presets import tiny_config
from akv_jax.serving.cache_manager import CacheManager
from akv_jax.serving.device_group import DeviceGroup
from akv_jax.serving.host_tier import HostKV


class RecordingMover:
    """Keeps page contents as numbers: device page d holds ``dev[d]``, host page h
    ``host[h]``; a copy moves them."""

    def __init__(self, num_pages: int):
        self.dev = {p: None for p in range(num_pages)}
        self.host: dict[int, object] = {}
        self.calls: list[tuple[str, int]] = []

    def offload(self, device_pages, host_pages):
        self.calls.append(("offload", len(device_pages)))
        for d, h in zip(device_pages, host_pages, strict=True):
            self.host[h] = self.dev[d]

    def reload(self, host_pages, device_pages):
        self.calls.append(("reload", len(device_pages)))
        for h, d in zip(host_pages, device_pages, strict=True):
            self.dev[d] = self.host[h]


def write(mover: RecordingMover, path) -> None:
    """Give every page on ``path`` a content naming its node and page (what a forward does)."""
    for n in path:
        for i, p in enumerate(n.pages or []):
            mover.dev[p] = (n.key[0], n.tok_start, i)


def test_live_kv_is_spilled_dead_kv_is_not_and_reload_restores_the_bytes():
    mover = RecordingMover(8)
    cm = CacheManager(8, 2, host_pages=4, mover=mover)
    tree = cm.tree
    a = insert(tree, [1, 1, 1, 1])  # 2 pages, live
    write(mover, a)
    a_bytes = [mover.dev[p] for p in a[0].pages]
    # A trajectory that drops its tool output (its own node): that node is dead.
    insert(tree, [7, 7])
    b = insert(tree, [7, 7, 8, 8, ("drop", ((0, 2),)), 9, 9])
    write(mover, b)
    for n in a:
        n.last_used -= 10  # a is the least recently used live KV
    assert tree.dead() == {b[0].id}
    assert tree.evict(3) >= 3  # the dead node first, then a (spilled)
    assert b[0].pages is None and b[0].host_pages is None  # dead: never offloaded
    assert a[0].pages is None and a[0].host_pages is not None
    assert mover.calls == [("offload", 2)]
    assert [mover.host[h] for h in a[0].host_pages] == a_bytes
    # A request needs a again: new device pages, the bytes come back.
    assert cm.alloc_nodes([a[0]])
    cm.reload([a[0]])
    assert [mover.dev[p] for p in a[0].pages] == a_bytes
    assert cm.stats()["reloaded_pages"] == 2 and cm.stats()["offloaded_pages"] == 2
    # Still on the host: evicting it again copies nothing.
    a[0].last_used -= 100
    tree.evict(2)
    assert a[0].pages is None and mover.calls[-1] == ("reload", 2)


def test_full_host_tier_evicts_its_least_recent_copy_and_splits_keep_tiers_aligned():
    mover = RecordingMover(8)
    cm = CacheManager(8, 2, host_pages=4, mover=mover)
    tree = cm.tree
    x = insert(tree, [1, 1, 2, 2])
    y = insert(tree, [3, 3, 4, 4])
    write(mover, x)
    write(mover, y)
    x[0].last_used -= 20
    y[0].last_used -= 10
    tree.evict(2)  # x spilled (oldest)
    assert x[0].host_pages is not None and y[0].host_pages is None
    tree.evict(8)  # y spilled: the host holds 4 pages, so both fit
    assert y[0].host_pages is not None and cm.host_used_pages == 4
    z = insert(tree, [5, 5, 6, 6])
    write(mover, z)
    tree.evict(8)  # z spilled: the host evicts x's copy (least recently used)
    assert x[0].host_pages is None and x[0].gone and z[0].host_pages is not None
    assert cm.stats()["host_evicted_pages"] == 2
    # A match that splits y (spilled, not resident) splits its host pages alike.
    y_host = list(y[0].host_pages)
    path = tree.match([3, 3, 9])
    upper = path[0]
    assert upper.host_pages == y_host[:1] and upper.children[4][0].host_pages == y_host[1:]
    cm.flush()
    assert cm.host_used_pages == 0 and cm.used_pages == 0


def test_host_kv_round_trip_is_bitwise_and_drains_in_order():
    cfg = tiny_config("qwen3")
    params = init_params(cfg, jax.random.key(0))
    group = DeviceGroup(cfg, params, num_pages=6, page_size=4, dtype=np.float32)
    rng = np.random.default_rng(0)
    k = rng.standard_normal(group.kv.k.shape).astype(np.float32)
    v = rng.standard_normal(group.kv.v.shape).astype(np.float32)
    group.kv = KVPool(k=jax.numpy.asarray(k), v=jax.numpy.asarray(v))
    host = HostKV(cfg, num_pages=3, page_size=4, dtype=np.float32)
    host.offload(group, [4, 1], [0, 2])
    host.offload(group, [5], [2])  # overwrites host page 2: the later copy must win
    host.reload([group], [2, 0], [0, 3])
    got_k, got_v = np.asarray(group.kv.k), np.asarray(group.kv.v)
    np.testing.assert_array_equal(got_k[:, 0], k[:, 5])
    np.testing.assert_array_equal(got_k[:, 3], k[:, 4])
    np.testing.assert_array_equal(got_v[:, 0], v[:, 5])
    np.testing.assert_array_equal(got_v[:, 3], v[:, 4])
    for p in (1, 2, 4, 5):  # untouched pages
        np.testing.assert_array_equal(got_k[:, p], k[:, p])
