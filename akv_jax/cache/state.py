"""CacheState: the immutable pytree a sequence's cache lives in.

One sequence, a fixed capacity of ``max_pages * page_size`` token slots. Tokens occupy slots
in logical order (slot i holds the i-th appended token, through ``page_table``); drop never
moves data, it clears ``active``; repos rewrites keys in place and ``positions``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from akv_jax.model.config import ModelConfig
from akv_jax.model.forward import KVPool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheState:
    kv: KVPool  # [L, max_pages, page_size, Hkv, Dh] keys (rotated) and values
    page_table: jax.Array  # [max_pages] int32 physical page of each logical page
    positions: jax.Array  # [N] int32 RoPE position each stored key is encoded at
    active: jax.Array  # [N] bool: still attended (False once dropped, or never written)
    segment: jax.Array  # [N] int32 segment id of each token (-1 for empty slots)
    length: jax.Array  # [] int32 tokens stored
    next_pos: jax.Array  # [] int32 position of the next appended token
    num_segments: jax.Array  # [] int32 segments appended
    ops: jax.Array  # [max_ops, 3] int32 op history (see akv_jax.cache.ops)
    num_ops: jax.Array  # [] int32 rows of ``ops`` in use

    @property
    def capacity(self) -> int:
        return self.positions.shape[0]

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @staticmethod
    def empty(
        cfg: ModelConfig,
        max_tokens: int,
        page_size: int = 16,
        max_ops: int = 256,
        dtype=jnp.float32,
    ) -> CacheState:
        pages = -(-max_tokens // page_size)
        n = pages * page_size
        return CacheState(
            kv=KVPool.zeros(cfg, pages, page_size, dtype),
            page_table=jnp.arange(pages, dtype=jnp.int32),
            positions=jnp.zeros(n, jnp.int32),
            active=jnp.zeros(n, bool),
            segment=jnp.full(n, -1, jnp.int32),
            length=jnp.zeros((), jnp.int32),
            next_pos=jnp.zeros((), jnp.int32),
            num_segments=jnp.zeros((), jnp.int32),
            ops=jnp.zeros((max_ops, 3), jnp.int32),
            num_ops=jnp.zeros((), jnp.int32),
        )

    def slot_keys(self) -> tuple[jax.Array, jax.Array]:
        """Keys and values in logical slot order: [L, N, Hkv, Dh] each."""
        k = self.kv.k[:, self.page_table]
        v = self.kv.v[:, self.page_table]
        L, P, ps, H, D = k.shape
        return k.reshape(L, P * ps, H, D), v.reshape(L, P * ps, H, D)
