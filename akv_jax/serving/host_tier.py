"""The host tier's storage: KV pages in host memory, filled by asynchronous device-to-host
copies and read back by host-to-device copies.

The bookkeeping (which node's KV sits in which host page, what to evict) is the cache
manager's; this module only moves bytes. A spill gathers the evicted pages on the device
(dispatched before any later step may overwrite them: one device runs its work in order)
and starts the copy to host memory without waiting for it; the copy is collected into the
numpy store only when a reload needs those pages, so spilling never stalls a step. Reloads
scatter into every group that reads the pages (both, when prefill and decode are
disaggregated), as handed-over prefill pages are.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.model.config import ModelConfig
from akv_jax.pallas.metadata import bucket
from akv_jax.serving.device_group import DeviceGroup, gather_pages, scatter_pages


class HostKV:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype):
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        # np.zeros maps untouched memory lazily: an idle tier costs no resident memory.
        self.k = np.zeros(shape, jnp.dtype(dtype))
        self.v = np.zeros(shape, jnp.dtype(dtype))
        self._pending: deque[tuple[np.ndarray, jax.Array, jax.Array]] = deque()

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    def offload(self, group: DeviceGroup, device_pages: Sequence[int],
                host_pages: Sequence[int]) -> None:
        """Start copying ``device_pages`` of ``group`` into ``host_pages`` (returns at once)."""
        n = len(device_pages)
        idx = np.zeros(bucket(n, 8), np.int32)  # padding reads page 0, written nowhere
        idx[:n] = device_pages
        k, v = gather_pages(group.kv, jnp.asarray(idx))
        k.copy_to_host_async()
        v.copy_to_host_async()
        self._pending.append((np.asarray(host_pages, np.int64), k, v))

    def drain(self, host_pages: Sequence[int] | None = None) -> None:
        """Finish pending copies into the store: all of them, or (``host_pages``) those up
        to the last one that writes any of these pages (later copies may overwrite pages an
        earlier one wrote, so they land in order)."""
        if host_pages is None:
            last = len(self._pending)
        else:
            want = set(host_pages)
            last = 0
            for i, (dst, _, _) in enumerate(self._pending):
                if want.intersection(dst.tolist()):
                    last = i + 1
        for _ in range(last):
            dst, k, v = self._pending.popleft()
            self.k[:, dst] = np.asarray(k)[:, : len(dst)]
            self.v[:, dst] = np.asarray(v)[:, : len(dst)]

    def reload(self, groups: Sequence[DeviceGroup], host_pages: Sequence[int],
               device_pages: Sequence[int]) -> None:
        """Copy ``host_pages`` into ``device_pages`` of every group in ``groups``."""
        self.drain(host_pages)
        n = len(host_pages)
        src = np.zeros(bucket(n, 8), np.int64)
        src[:n] = host_pages
        dst = np.full(len(src), groups[0].kv.k.shape[1], np.int32)  # padding: dropped
        dst[:n] = device_pages
        k, v = self.k[:, src], self.v[:, src]  # fancy indexing copies: the store may change
        for g in groups:
            target = g.kv_sharding or next(iter(g.kv.k.devices()))
            g.kv = scatter_pages(g.kv, jnp.asarray(dst), jax.device_put(k, target),
                                 jax.device_put(v, target))
