"""Synthetic segment batches shaped like AKV's three paths, for kernel tests and benchmarks
(a test-support module: ``tests/`` imports it directly, ``bench/kernels.py`` puts ``tests/``
on ``sys.path`` first).

* :func:`decode_case`: one query token per request over its own view, with message-sized
  spans dropped;
* :func:`prefill_case`: a new segment after a cached prefix with dropped spans;
* :func:`restore_case`: the one-pass restore of an op history: segments that each see the
  KV they originally saw, including a position version after a repos (a second copy of the
  survivors on other pages) and a dropped segment left as a gap.

Metadata is built on the host (numpy), data on the device (``jax.random``). Physical pages
are shuffled, with spare pages between them; :func:`materialize` fills every slot that no
segment may attend (spare pages, the tail of partial pages, dropped-everywhere slots) with
NaN, so a kernel that reads what it must not read produces NaN.

The attention tests' shared checks live here too: :func:`case_of_kind` (their standard case
of each kind), :func:`dense_oracle` (float64 numpy) and :func:`assert_close`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.pallas.metadata import SegmentBatch, SegmentSpec, bucket, build_segment_batch


@dataclasses.dataclass
class Case:
    specs: list[SegmentSpec]
    num_rows: int  # T: query rows (the last ones may be uncovered padding)
    num_pages: int  # P
    page_size: int
    block_q: int

    def batch(self) -> SegmentBatch:
        return build_segment_batch(self.specs, page_size=self.page_size, block_q=self.block_q)

    def attended_slots(self) -> np.ndarray:
        """[P, page_size] bool: slots at least one segment may attend."""
        used = np.zeros((self.num_pages, self.page_size), bool)
        for s in self.specs:
            idx = np.flatnonzero(s.kv_visible)
            used[np.asarray(s.pages)[idx // self.page_size], idx % self.page_size] = True
        return used


class _Pages:
    """Hands out shuffled physical page ids with spare pages left unused in between."""

    def __init__(self, rng: np.random.Generator, needed: int, spare: int):
        self.ids = rng.permutation(needed + spare).astype(np.int32)
        self.total = needed + spare
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = self.ids[self.next : self.next + n]
        self.next += n
        return out.tolist()


def _pages_for(n_tokens: int, ps: int) -> int:
    return -(-n_tokens // ps)


def drop_spans(
    rng: np.random.Generator, n: int, fraction: float, span: int, keep_tail: int = 1
) -> np.ndarray:
    """[n] visibility with ``round(fraction * spans)`` message-sized spans dropped.

    The last ``keep_tail`` tokens (the query itself) always stay visible.
    """
    vis = np.ones(n, bool)
    body = max(n - keep_tail, 0)
    spans = -(-body // span) if body else 0
    k = int(round(fraction * spans))
    for s in rng.choice(spans, size=k, replace=False) if k else []:
        vis[s * span : min((s + 1) * span, body)] = False
    return vis


def decode_case(
    rng: np.random.Generator,
    kv_lens: list[int],
    *,
    page_size: int,
    drop_fraction: float = 0.0,
    span: int = 48,
    spare_pages: int = 3,
) -> Case:
    """One decode token per request; request b's view holds ``kv_lens[b]`` slots."""
    ps = page_size
    alloc = _Pages(rng, sum(_pages_for(n, ps) for n in kv_lens), spare_pages)
    specs = []
    for b, n in enumerate(kv_lens):
        specs.append(
            SegmentSpec(
                q_start=b,
                q_len=1,
                pages=alloc.take(_pages_for(n, ps)),
                kv_visible=drop_spans(rng, n, drop_fraction, span),
                causal_pos=n - 1,
            )
        )
    return Case(specs, bucket(len(kv_lens), 1), alloc.total, ps, block_q=1)


def prefill_case(
    rng: np.random.Generator,
    cached: int,
    new: int,
    *,
    page_size: int,
    block_q: int,
    drop_fraction: float = 0.0,
    span: int = 40,
    spare_pages: int = 3,
) -> Case:
    """A new segment of ``new`` tokens after ``cached`` cached ones (some dropped)."""
    ps = page_size
    n = cached + new
    alloc = _Pages(rng, _pages_for(n, ps), spare_pages)
    vis = np.ones(n, bool)
    vis[:cached] = drop_spans(rng, cached, drop_fraction, span, keep_tail=0)
    spec = SegmentSpec(
        q_start=0, q_len=new, pages=alloc.take(_pages_for(n, ps)), kv_visible=vis,
        causal_pos=cached,
    )
    return Case([spec], bucket(new, block_q), alloc.total, ps, block_q)


def restore_case(
    rng: np.random.Generator,
    seg_lens: tuple[int, int, int, int, int],
    *,
    page_size: int,
    block_q: int,
    spare_pages: int = 3,
) -> Case:
    """One-pass restore of ``A B C | drop B, repos | D | drop D | E`` (five segments, one batch).

    A, B, C are appended on one page run and each sees everything before it (C sees B: the
    drop comes after C). D comes after dropping B and a repos, so it reads a position version:
    the survivors A, C copied to a second page run at 0..r-1, then itself. E comes after
    dropping D (no repos): same run, D's slots invisible, E after them (the paper's Figure 10).
    """
    a, b, c, d, e = seg_lens
    ps = page_size
    n1, r = a + b + c, a + c
    alloc = _Pages(rng, _pages_for(n1, ps) + _pages_for(r + d + e, ps), spare_pages)
    run1 = alloc.take(_pages_for(n1, ps))
    run2 = alloc.take(_pages_for(r + d + e, ps))
    views = [  # (run, causal_pos, q_len, visibility)
        (run1, 0, a, np.ones(a, bool)),
        (run1, a, b, np.ones(a + b, bool)),
        (run1, a + b, c, np.ones(n1, bool)),
        (run2, r, d, np.ones(r + d, bool)),
        (run2, r + d, e, np.r_[np.ones(r, bool), np.zeros(d, bool), np.ones(e, bool)]),
    ]
    specs, row = [], 0
    for run, pos, q_len, vis in views:
        pages = run[: _pages_for(len(vis), ps)]
        specs.append(SegmentSpec(q_start=row, q_len=q_len, pages=pages, kv_visible=vis,
                                 causal_pos=pos))
        row += q_len
    return Case(specs, bucket(row, block_q), alloc.total, ps, block_q)


def history_case(
    rng: np.random.Generator,
    context: int,
    *,
    msg_len: int,
    drop_fraction: float,
    page_size: int,
    block_q: int,
    spare_pages: int = 3,
) -> Case:
    """One-pass restore of a rolling-drop history: ``context / msg_len`` messages on one page
    run; message ``s`` attends to every earlier message not yet dropped, and a
    ``drop_fraction`` of the messages (never the last) is dropped, each at a random boundary
    after it. The restore recomputes every message at once, each seeing what it saw."""
    ps = page_size
    n = max(1, context // msg_len)
    alloc = _Pages(rng, _pages_for(n * msg_len, ps), spare_pages)
    run = alloc.take(_pages_for(n * msg_len, ps))
    k = int(round(drop_fraction * (n - 1)))
    dropped_at = np.full(n, n + 1)  # boundary after which message i is invisible
    for i in rng.choice(n - 1, size=k, replace=False) if k else []:
        dropped_at[i] = rng.integers(i, n - 1)
    specs = []
    for s in range(n):
        end = (s + 1) * msg_len
        vis = np.repeat(dropped_at[: s + 1] >= s, msg_len)  # dropped before s: invisible
        vis[s * msg_len :] = True
        specs.append(SegmentSpec(q_start=s * msg_len, q_len=msg_len,
                                 pages=run[: _pages_for(end, ps)], kv_visible=vis,
                                 causal_pos=s * msg_len))
    return Case(specs, n * msg_len, alloc.total, ps, block_q)


def attended_pairs(case: Case) -> int:
    """(query row, key) pairs the batch attends: the work a kernel cannot avoid."""
    total = 0
    for s in case.specs:
        c = np.cumsum(s.kv_visible)
        rows = np.minimum(s.causal_pos + np.arange(s.q_len), len(s.kv_visible) - 1)
        total += int(c[rows].sum())
    return total


def visible_pages(case: Case) -> int:
    """Distinct physical pages holding a slot some segment attends."""
    return int(case.attended_slots().any(axis=1).sum())


def poisoned_pools(rng: np.random.Generator, num_pages: int, page_size: int, kv_heads: int,
                   head_dim: int, poisoned_from: int) -> tuple[np.ndarray, np.ndarray]:
    """Random key and value pools ``[P, ps, Hkv, Dh]`` whose pages from ``poisoned_from`` on
    hold NaN: no view may read them, and a kernel that does shows it."""
    shape = (num_pages, page_size, kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[poisoned_from:], v[poisoned_from:] = np.nan, np.nan
    return k, v


def materialize(
    case: Case,
    key: jax.Array | np.random.Generator,
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype=jnp.float32,
    nan_fill: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array, SegmentBatch]:
    """Random ``q [T, Hq, Dh]``, ``k_pages``, ``v_pages`` and the batch for ``case``.

    ``key``: a numpy Generator draws on the host (no compile: right for test-sized cases); a
    ``jax.random`` key draws on the device (right for benchmark-sized pools).
    """
    shape = (case.num_pages, case.page_size, num_kv_heads, head_dim)
    q_shape = (case.num_rows, num_kv_heads * group, head_dim)
    used = case.attended_slots()[:, :, None, None]
    if isinstance(key, np.random.Generator):
        q, k, v = (key.standard_normal(s, np.float32) for s in (q_shape, shape, shape))
        if nan_fill:
            k, v = np.where(used, k, np.nan), np.where(used, v, np.nan)
    else:
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, q_shape, jnp.float32)
        k = jax.random.normal(kk, shape, jnp.float32)
        v = jax.random.normal(kv, shape, jnp.float32)
        if nan_fill:
            k, v = jnp.where(used, k, jnp.nan), jnp.where(used, v, jnp.nan)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), case.batch()


def mixed_case(
    rng: np.random.Generator,
    *,
    num_segments: int,
    page_size: int,
    block_q: int,
    max_rows: int = 20,
    spare_pages: int = 3,
) -> Case:
    """Decode rows and multi-row prefill segments in one batch, over views laid out like the
    server's: message nodes on their own pages (the tail of each last page is padding,
    invisible in the middle of the view), some messages dropped, and a few single entries
    dropped at random. About a third of the segments are decode rows (one query token)."""
    ps = page_size
    layouts = []
    for _ in range(num_segments):
        parts = []
        for _ in range(int(rng.integers(0, 6))):
            n = int(rng.integers(1, 3 * ps + 2))
            vis = np.zeros(_pages_for(n, ps) * ps, bool)
            vis[:n] = rng.random() < 0.7  # a dropped message, or a kept one
            vis[:n] &= rng.random(n) > 0.1
            parts.append(vis)
        q_len = 1 if rng.random() < 0.35 else int(rng.integers(2, max_rows + 1))
        layouts.append((parts, q_len))
    need = sum(_pages_for(sum(len(p) for p in parts) + q, ps) for parts, q in layouts)
    alloc = _Pages(rng, need, spare_pages)
    specs, row = [], 0
    for parts, q_len in layouts:
        before = np.concatenate([*parts, np.zeros(0, bool)])
        vis = np.r_[before, np.ones(q_len, bool)]
        pages = alloc.take(_pages_for(len(vis), ps))
        specs.append(SegmentSpec(q_start=row, q_len=q_len, pages=pages, kv_visible=vis,
                                 causal_pos=len(before)))
        row += q_len
    return Case(specs, bucket(row, block_q), alloc.total, ps, block_q)


TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # assert_close's atol and rtol, by dtype


def case_of_kind(kind: str, *, page_size: int, seed: int = 0, block_q: int | None = None) -> Case:
    """The standard case of each kind the attention tests run: ``decode`` (one request sees
    nothing), ``prefill``, ``restore``, or ``long`` (512 query rows)."""
    rng = np.random.default_rng(seed)
    if kind == "decode":
        lens = [1, 37, page_size * 3, 150, 96, 200, 50]  # a lone token, partial and full pages
        case = decode_case(rng, lens, page_size=page_size, drop_fraction=0.5, span=24)
        # The last request sees nothing at all (its row must come out as zeros, not NaN).
        blind = case.specs[-1]
        case.specs[-1] = dataclasses.replace(blind, kv_visible=np.zeros_like(blind.kv_visible))
        return case
    if kind == "prefill":
        return prefill_case(
            rng, 160, 90, page_size=page_size, block_q=block_q or 32, drop_fraction=0.4
        )
    if kind == "restore":
        return restore_case(rng, (20, 70, 25, 40, 30), page_size=page_size,
                            block_q=block_q or 16)
    if kind == "long":  # the largest: 512 query rows
        return prefill_case(
            rng, 0, 512, page_size=page_size, block_q=block_q or 64, drop_fraction=0.0
        )
    raise ValueError(kind)


def dense_oracle(q, k_pages, v_pages, specs, page_size, sm_scale, sinks=None, window=None):
    """Per-token softmax over exactly the keys each query row may see, in float64 numpy.

    A sliding window keeps the ``window`` most recent *visible* keys at or before the row
    (DESIGN §2.1: the W most recent entries of its view, itself included)."""
    q = np.asarray(q, np.float64)
    k_pages, v_pages = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64)
    T, Hq, Dh = q.shape
    Hkv = k_pages.shape[2]
    G = Hq // Hkv
    out = np.zeros_like(q)
    for spec in specs:
        n = len(spec.kv_visible)
        keys = k_pages[np.asarray(spec.pages)].reshape(-1, Hkv, Dh)[:n]
        vals = v_pages[np.asarray(spec.pages)].reshape(-1, Hkv, Dh)[:n]
        for i in range(spec.q_len):
            c = spec.causal_pos + i
            idx = np.flatnonzero(spec.kv_visible[: c + 1])  # its view, in append order
            if window is not None:
                idx = idx[max(len(idx) - window, 0) :]
            for h in range(Hq):
                logits = keys[idx, h // G] @ q[spec.q_start + i, h] * sm_scale
                extra = [] if sinks is None else [float(sinks[h])]
                if len(idx) == 0 and not extra:
                    continue
                m = max(list(logits) + extra)
                e = np.exp(logits - m)
                denom = e.sum() + sum(np.exp(x - m) for x in extra)
                out[spec.q_start + i, h] = e @ vals[idx, h // G] / denom
    return out


def assert_close(out, want, dtype) -> None:
    """``out`` has no NaN (no masked slot was read) and is within ``TOL[dtype]`` of ``want``."""
    out = np.asarray(jnp.asarray(out, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert not np.isnan(out).any(), "NaN in output: a masked slot was read"
    np.testing.assert_allclose(out, want, atol=TOL[dtype], rtol=TOL[dtype])
