"""append / drop / repos as pure jit-able functions, and the one-pass restore.

Incremental ops act on a :class:`CacheState`. Shapes are static: a segment is padded to a
multiple of ``block_q`` tokens (``n`` valid), drop lists are padded with -1, the state has a
fixed capacity. So a Python loop of ops over one state, wrapped in one ``jax.jit``, compiles
to one program (see :func:`run_history`), and separate calls with equally padded segments
reuse compiled code.

:func:`restore` computes the state a whole history leaves, and every token's logits, in
**one** forward pass: queries are cut at segment boundaries, each segment attends to the keys
it saw when it was appended (its epoch's position version, its visibility), and the FFN runs
once over all tokens. The same function with an empty history is a plain causal prefill.
Its host-side plan (which slots each version writes, what each segment sees) is
:mod:`akv_jax.cache.restore_plan`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.cache.ops import OP_APPEND, OP_DROP, OP_REPOS, OpHistory, encode_history
from akv_jax.cache.restore_plan import plan
from akv_jax.cache.state import CacheState
from akv_jax.model.config import ModelConfig
from akv_jax.model.forward import KVPool, KVWrites, forward, make_model_attention
from akv_jax.model.params import Params
from akv_jax.model.rope import rope_table_for
from akv_jax.pallas.metadata import AttentionFn, SegmentBatch, bucket, build_segment_batch
from akv_jax.pallas.rotary import RopeTable, rerotate

# ----------------------------------------------------------------------------- incremental


def _record(state: CacheState, rows: jax.Array, count: jax.Array) -> CacheState:
    """Append ``count`` leading rows of ``rows`` [K, 3] to the op history."""
    idx = state.num_ops + jnp.arange(rows.shape[0])
    keep = jnp.arange(rows.shape[0]) < count
    rows = jnp.where(keep[:, None], rows, 0)
    ops = state.ops.at[jnp.where(keep, idx, state.ops.shape[0])].set(rows, mode="drop")
    return dataclasses.replace(state, ops=ops, num_ops=state.num_ops + count)


def _append_batch(state: CacheState, active: jax.Array, n: jax.Array, nb: int, block_q: int):
    """Device-side segment batch for one appended segment (the view is the whole state)."""
    b = jnp.arange(nb, dtype=jnp.int32)
    start = b * block_q
    q_len = jnp.clip(n - start, 0, block_q)
    kv_len = state.length + n
    visible = active & (jnp.arange(active.shape[0]) < kv_len)
    mp, ps = state.page_table.shape[0], state.page_size
    return SegmentBatch(
        block_seg=jnp.where(q_len > 0, 0, -1).astype(jnp.int32),
        block_q_start=start,
        block_q_len=q_len,
        block_kv_pos=state.length + start,
        page_table=state.page_table[None],
        kv_len=kv_len[None],
        kv_visible=visible[None],
        page_visible=visible.reshape(1, mp, ps).any(-1),
    )


def append(
    params: Params,
    state: CacheState,
    tokens: jax.Array,
    n: jax.Array | int,
    *,
    cfg: ModelConfig,
    rope: RopeTable,
    attention: AttentionFn,
    block_q: int,
) -> tuple[jax.Array, CacheState]:
    """Append one segment: ``tokens`` [T] padded (T a multiple of block_q), ``n`` valid.

    Each token is computed at ``next_pos + i``, attending to every active cached entry and
    to the earlier tokens of its own segment. Returns (logits [T, V], new state); rows past
    ``n`` are padding. Appending past the capacity drops the overflow (check ``length``).
    """
    T = tokens.shape[0]
    n = jnp.asarray(n, jnp.int32)
    i = jnp.arange(T, dtype=jnp.int32)
    valid = i < n
    pos = state.next_pos + i
    slot_logical = state.length + i
    ps = state.page_size
    phys = state.page_table[jnp.clip(slot_logical // ps, 0, state.page_table.shape[0] - 1)]
    slots = jnp.where(valid & (slot_logical < state.capacity), phys * ps + slot_logical % ps, -1)
    slots = jnp.where(slots < 0, state.capacity, slots)
    seg_id = state.num_segments
    tgt = jnp.where(valid, slot_logical, state.capacity)
    active = state.active.at[tgt].set(True, mode="drop")
    batch = _append_batch(state, active, n, T // block_q, block_q)
    writes = KVWrites(slots=slots[None], positions=pos[None])
    logits, kv = forward(params, cfg, tokens, pos, state.kv, writes, batch, rope, attention)
    state = dataclasses.replace(
        state,
        kv=kv,
        positions=state.positions.at[tgt].set(pos, mode="drop"),
        active=active,
        segment=state.segment.at[tgt].set(seg_id, mode="drop"),
        length=state.length + n,
        next_pos=state.next_pos + n,
        num_segments=seg_id + 1,
    )
    row = jnp.stack([jnp.int32(OP_APPEND), seg_id, n])[None]
    return logits, _record(state, row, jnp.int32(1))


def drop(state: CacheState, segments: jax.Array) -> CacheState:
    """Deactivate ``segments`` [K] (padded with -1, valid ids first). Moves no data."""
    segments = jnp.asarray(segments, jnp.int32)
    hit = (state.segment[:, None] == segments[None, :]) & (segments[None, :] >= 0)
    active = state.active & ~hit.any(axis=1)
    count = (segments >= 0).sum().astype(jnp.int32)
    boundary = state.num_segments - 1
    rows = jnp.stack(
        [jnp.full_like(segments, OP_DROP), jnp.full_like(segments, boundary), segments], axis=1
    )
    return _record(dataclasses.replace(state, active=active), rows, count)


def repos(state: CacheState, *, rope: RopeTable) -> CacheState:
    """Re-encode the r active entries at positions 0..r-1 (K re-rotated, V untouched)."""
    r_idx = jnp.cumsum(state.active) - 1
    new_pos = jnp.where(state.active, r_idx, state.positions).astype(jnp.int32)
    k, _ = state.slot_keys()
    L, N, H, D = k.shape

    def one_layer(kl):
        rot = rerotate(kl, state.positions, new_pos, rope)
        # Inactive keys are never read again; keep them bit-identical rather than round-trip.
        return jnp.where(state.active[:, None, None], rot, kl)

    k_new = jax.vmap(one_layer)(k).reshape(L, -1, state.page_size, H, D)
    kv_k = state.kv.k.at[:, state.page_table].set(k_new)
    r = state.active.sum().astype(jnp.int32)
    row = jnp.stack([jnp.int32(OP_REPOS), state.num_segments - 1, jnp.int32(0)])[None]
    state = dataclasses.replace(
        state, kv=KVPool(k=kv_k, v=state.kv.v), positions=new_pos, next_pos=r
    )
    return _record(state, row, jnp.int32(1))


@dataclasses.dataclass(frozen=True)
class CacheOps:
    """jit-compiled ops bound to one model: the notebook-facing API.

    >>> ops = CacheOps(cfg)
    >>> state = ops.empty(max_tokens=512)
    >>> logits, state = ops.append(params, state, [1, 2, 3])
    >>> state = ops.drop(state, [0]); state = ops.repos(state)
    """

    cfg: ModelConfig
    backend: str = "reference"
    block_q: int = 16
    page_size: int = 16

    @functools.cached_property
    def rope(self) -> RopeTable:
        return rope_table_for(self.cfg)

    @functools.cached_property
    def _append(self):
        attn = make_model_attention(self.cfg, self.backend, self.block_q)
        fn = functools.partial(
            append, cfg=self.cfg, attention=attn, block_q=self.block_q, rope=self.rope
        )
        return jax.jit(fn, donate_argnums=1)

    @functools.cached_property
    def _drop(self):
        return jax.jit(drop, donate_argnums=0)

    @functools.cached_property
    def _repos(self):
        return jax.jit(functools.partial(repos, rope=self.rope), donate_argnums=0)

    def empty(self, max_tokens: int, max_ops: int = 256, dtype=jnp.float32) -> CacheState:
        return CacheState.empty(self.cfg, max_tokens, self.page_size, max_ops, dtype)

    def pad_segment(self, tokens: Sequence[int]) -> tuple[jax.Array, int]:
        n = len(tokens)
        T = bucket(n, self.block_q, steps_per_octave=4)
        out = np.zeros(T, np.int32)
        out[:n] = tokens
        return jnp.asarray(out), n

    def append(self, params: Params, state: CacheState, tokens: Sequence[int]):
        """Append a segment; returns (logits [n, V], state)."""
        padded, n = self.pad_segment(tokens)
        logits, state = self._append(params, state, padded, n)
        return logits[:n], state

    def drop(self, state: CacheState, segments: Sequence[int]) -> CacheState:
        k = bucket(max(len(segments), 1), 4)
        arr = np.full(k, -1, np.int32)
        arr[: len(segments)] = segments
        return self._drop(state, jnp.asarray(arr))

    def repos(self, state: CacheState) -> CacheState:
        return self._repos(state)

    def run(self, params: Params, state: CacheState, segments, history: OpHistory):
        """Op by op (one compiled call per op): the incremental path and restore's baseline."""
        logits = []
        for s, seg in enumerate(segments):
            lg, state = self.append(params, state, seg)
            logits.append(lg)
            if history.drops_at(s):
                state = self.drop(state, list(history.drops_at(s)))
            if history.repos_at(s):
                state = self.repos(state)
        return jnp.concatenate(logits), state


def run_history(
    params: Params,
    state: CacheState,
    segments: Sequence[jax.Array],
    lengths: Sequence[jax.Array],
    history: OpHistory,
    *,
    cfg: ModelConfig,
    rope: RopeTable,
    attention: AttentionFn,
    block_q: int,
) -> tuple[list[jax.Array], CacheState]:
    """A whole op sequence as one traceable function: wrap it in ``jax.jit`` with ``history``
    (and cfg, attention, block_q) static; segments are padded token arrays."""
    logits = []
    for s, (tokens, n) in enumerate(zip(segments, lengths, strict=True)):
        lg, state = append(
            params, state, tokens, n, cfg=cfg, rope=rope, attention=attention, block_q=block_q
        )
        logits.append(lg)
        if history.drops_at(s):
            state = drop(state, jnp.asarray(history.drops_at(s), jnp.int32))
        if history.repos_at(s):
            state = repos(state, rope=rope)
    return logits, state


# ----------------------------------------------------------------------------- one pass


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "block_q"))
def _restore_forward(params, cfg, tokens, q_pos, kv, writes, batch, rope, backend, block_q):
    attention = make_model_attention(cfg, backend, block_q)
    return forward(params, cfg, tokens, q_pos, kv, writes, batch, rope, attention)


def restore(
    params: Params,
    cfg: ModelConfig,
    segments: Sequence[Sequence[int]],
    history: OpHistory,
    *,
    max_tokens: int,
    page_size: int = 16,
    block_q: int = 16,
    max_ops: int = 256,
    backend: str = "reference",
    rope: RopeTable | None = None,
    static_sizes: bool = False,
) -> tuple[jax.Array, CacheState]:
    """One-pass restore: (logits of every token [T, V], the final :class:`CacheState`).

    Equal (to float rounding) to running the history op by op from an empty state. With
    ``static_sizes`` every padded dimension depends only on ``max_tokens`` (and the number
    of versions is padded to 8), so all histories of that capacity share compiled code.
    """
    rope = rope if rope is not None else rope_table_for(cfg)
    max_pages = -(-max_tokens // page_size)
    n = max_pages * page_size
    sizes = {}
    if static_sizes:
        sizes = dict(t_pad=-(-n // block_q) * block_q, num_versions=8)
    p = plan(segments, history, max_pages=max_pages, page_size=page_size, block_q=block_q, **sizes)
    tl = p.timeline
    batch = build_segment_batch(
        p.segments,
        page_size=page_size,
        block_q=block_q,
        max_pages=bucket(max_pages, 1),
        num_blocks=sizes["t_pad"] // block_q + bucket(len(segments), 16) if static_sizes else None,
        num_segments=bucket(len(segments), 16) if static_sizes else None,
    )
    dtype = params.embed.dtype
    kv = KVPool.zeros(cfg, p.pool_pages, page_size, dtype)
    writes = KVWrites(slots=jnp.asarray(p.write_slots), positions=jnp.asarray(p.write_positions))
    logits, kv = _restore_forward(
        params,
        cfg,
        jnp.asarray(p.tokens),
        jnp.asarray(p.q_positions),
        kv,
        writes,
        batch,
        rope,
        backend,
        block_q,
    )
    T = tl.num_tokens
    positions = np.zeros(n, np.int32)
    positions[:T] = tl.final_pos
    active = np.zeros(n, bool)
    active[:T] = tl.final_active
    segment = np.full(n, -1, np.int32)
    segment[:T] = tl.token_seg
    state = CacheState(
        kv=KVPool(k=kv.k[:, :max_pages], v=kv.v[:, :max_pages]),
        page_table=jnp.arange(max_pages, dtype=jnp.int32),
        positions=jnp.asarray(positions),
        active=jnp.asarray(active),
        segment=jnp.asarray(segment),
        length=jnp.int32(T),
        next_pos=jnp.int32(tl.next_pos),
        num_segments=jnp.int32(tl.num_segments),
        ops=jnp.asarray(encode_history(history, tl.seg_lens, max_ops)),
        num_ops=jnp.int32(len(encode_history(history, tl.seg_lens))),
    )
    return logits[:T], state
