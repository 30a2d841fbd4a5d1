"""The serving engine: plans each request against the op-aware radix tree, runs one
jit-compiled forward per scheduler step over every request's work, samples.

Request life cycle:

1. ``add_request`` validates and queues. The request's history is flattened into radix keys
   (tokens and op items) and its :class:`Timeline` says, for every token, its positions in
   every version and which segments see it.
2. Prefill, planned as **one pass** per request: match the longest stored prefix; decide which
   nodes must be computed (new nodes, the last token node for its logits, and any emptied
   node whose KV is still visible to something computed: that is the one-pass restore); lay
   out pages; keys that a repos re-encodes are written once per position version by the same
   forward, or re-rotated from resident pages before it (pre-pass copies). The pass runs in
   slices of at most ``prefill_chunk`` rows over consecutive steps (chunked prefill), so a
   long prompt never stalls running decodes for more than one slice; rows only read KV of
   earlier rows, which earlier slices have written.
3. Decode: one token per running request per step, its view the request's final version.
4. Finish: generated tokens become a token node, the path is unlocked.

Everything here is host-side bookkeeping; the device sees only :func:`forward` and
:func:`_rerotate_copy` with padded, bucketed arrays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.cache.core import attention_fn
from akv_jax.cache.ops import CacheOpError, OpHistory
from akv_jax.cache.timeline import Timeline, timeline
from akv_jax.model.forward import KVWrites
from akv_jax.model.rope import rope_table_for
from akv_jax.pallas.metadata import SegmentSpec, bucket, build_segment_batch
from akv_jax.serving.device_group import DeviceGroup, transfer_pages
from akv_jax.serving.multihost import STOP, apply_commands, broadcast_object
from akv_jax.serving.page_pool import PagePool
from akv_jax.serving.radix import Node, RadixTree


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclasses.dataclass
class GenerateRequest:
    rid: str
    segments: list[list[int]]
    history: OpHistory
    sampling: SamplingParams = SamplingParams()
    return_logprob: bool = False


@dataclasses.dataclass
class TokenEvent:
    rid: str
    token_id: int
    logprob: float | None
    finished: bool
    finish_reason: str | None
    meta: dict


PREFILL_BLOCK_Q = 64  # query rows per attention block in prefill forwards


# Few shapes, so that a few compiled programs serve every step: the token count in
# half-octave steps; views in powers of two from 4,096 tokens. ``_run`` pads with these and
# ``Engine.warm_up_shapes`` enumerates them.
def _token_bucket(n: int, block_q: int) -> int:
    return bucket(n, max(block_q, 8 if block_q == 1 else 64), steps_per_octave=2)


def _view_bucket(pages: int, page_size: int) -> int:
    return bucket(pages, max(1, 4096 // page_size))


def _distinct_buckets(limit: int, pad) -> list[int]:
    """Every value ``pad(n)`` takes for ``n`` in ``1..limit``, ascending."""
    out: list[int] = []
    n = 1
    while n <= limit:
        out.append(pad(n))
        n = out[-1] + 1
    return out


def request_keys(segments: Sequence[Sequence[int]], history: OpHistory):
    """Radix keys of a request; for each key its absolute token index (-1 for an op) and
    its boundary (the segment an op follows; -1 for a token)."""
    keys: list = []
    tok_index: list[int] = []
    boundary: list[int] = []
    starts = np.concatenate([[0], np.cumsum([len(s) for s in segments])]).tolist()
    for s, seg in enumerate(segments):
        keys.extend(int(t) for t in seg)
        tok_index.extend(range(starts[s], starts[s + 1]))
        boundary.extend([-1] * len(seg))
        ops = []
        if history.drops_at(s):
            ops.append(("drop", tuple((starts[i], starts[i + 1]) for i in history.drops_at(s))))
        if history.repos_at(s):
            ops.append(("repos",))
        keys.extend(ops)
        tok_index.extend([-1] * len(ops))
        boundary.extend([s] * len(ops))
    return keys, tok_index, boundary


@dataclasses.dataclass
class _Request:
    req: GenerateRequest
    tl: Timeline
    keys: list
    tok_index: list[int]
    key_boundary: list[int]
    arrival: float
    status: str = "waiting"  # waiting | prefill | decode | done
    last_node: Node | None = None
    prompt_last_node: Node | None = None
    # The final version's view, snapshotted as pages and slot tokens: nodes may be split
    # later by other requests' matches, but their pages never move.
    view_pages: list[int] = dataclasses.field(default_factory=list)
    view_toks: np.ndarray | None = None
    view_nodes: list[Node] = dataclasses.field(default_factory=list)  # final view, any visible
    gen_pages: list[int] = dataclasses.field(default_factory=list)
    generated: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    rng: np.random.Generator | None = None
    prefill: _Pass | None = None  # the planned pass while it runs, slice by slice
    prefill_done: int = 0  # rows of it already run

    @property
    def rid(self) -> str:
        return self.req.rid


@dataclasses.dataclass
class _Pass:
    """One request's share of a step: query segments, writes and pre-pass copies."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    q_pos: list[int] = dataclasses.field(default_factory=list)
    writes: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    segments: list[SegmentSpec] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    logits_row: int = -1  # -1: no logits wanted (a slice before the last)
    written_pages: list[int] = dataclasses.field(default_factory=list)

    def slice(self, a: int, b: int) -> _Pass:
        """Rows ``[a, b)`` as a pass of their own: segments cut to those rows (a cut
        segment's first row moves ``causal_pos`` on; its view and pages stay), pre-pass copies
        with the first slice (their sources are resident), logits with the slice holding
        ``logits_row``."""
        segs = []
        for s in self.segments:
            lo, hi = max(a, s.q_start), min(b, s.q_start + s.q_len)
            if lo < hi:
                segs.append(dataclasses.replace(
                    s, q_start=lo - a, q_len=hi - lo, causal_pos=s.causal_pos + lo - s.q_start
                ))
        return _Pass(
            tokens=self.tokens[a:b],
            q_pos=self.q_pos[a:b],
            writes=self.writes[a:b],
            segments=segs,
            copies=self.copies if a == 0 else [],
            logits_row=self.logits_row - a if a <= self.logits_row < b else -1,
        )


class Engine:
    def __init__(
        self,
        model,
        *,
        max_total_tokens: int = 16384,
        page_size: int = 16,
        attention_backend: str = "auto",
        max_running: int = 16,
        prefill_chunk: int = 4096,
        kv_dtype=None,
        tp: int = 1,
        disaggregate: tuple[int, int] | None = None,
        devices=None,
    ):
        """``tp``: tensor-parallel degree of the (colocated) device group.
        ``disaggregate=(P, D)``: prefill and restores on the first P devices, decode on the
        next D (each group tensor-parallel over its devices), KV pages handed between them."""
        self.cfg = model.cfg
        tok = getattr(model, "tokenizer", None)
        self.eos_ids = set(model.cfg.eos_token_ids) | set(getattr(tok, "eos_ids", ()) or ())
        self.page_size = page_size
        self.num_pages = max(2, -(-max_total_tokens // page_size))
        dtype = kv_dtype or model.params.embed.dtype
        devices = list(devices if devices is not None else jax.devices())

        def group(devs):
            return DeviceGroup(self.cfg, model.params, self.num_pages, page_size, dtype, devs)

        if disaggregate is not None:
            n_p, n_d = disaggregate
            if n_p < 1 or n_d < 1 or n_p + n_d > len(devices):
                raise ValueError(
                    f"--disaggregate {n_p},{n_d} needs {n_p + n_d} devices, found {len(devices)}"
                )
            self.prefill = group(devices[:n_p])
            self.decode = group(devices[n_p : n_p + n_d])
        else:
            if tp > len(devices):
                raise ValueError(f"--tp {tp} needs {tp} devices, found {len(devices)}")
            self.prefill = self.decode = group(devices[:tp] if tp > 1 else None)
        self.pool = PagePool(self.num_pages)
        self.tree = RadixTree(self.pool, page_size)
        self.rope = rope_table_for(self.cfg)
        self.backend = attention_backend
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[_Request] = deque()
        self.running: dict[str, _Request] = {}
        self.counters = dict(
            cache_queries=0,
            cache_query_tokens=0,
            cache_hit_tokens=0,
            restores=0,
            restored_tokens=0,
            requests_finished=0,
        )
        self.prefilling: dict[str, _Request] = {}  # admitted, prefill slices still to run
        self._step_id = 0
        self._attn = {
            bq: attention_fn(self.cfg, attention_backend, bq) for bq in (1, PREFILL_BLOCK_Q)
        }

    # ------------------------------------------------------------------ admission
    def check(self, req: GenerateRequest) -> Timeline:
        """Validate what only the engine knows (vocabulary, position limit, pool size)."""
        V = self.cfg.vocab_size
        for i, seg in enumerate(req.segments):
            if not seg:
                raise CacheOpError(f"input_ids[{i}]", "empty segment")
            for j, t in enumerate(seg):
                if not 0 <= t < V:
                    raise CacheOpError(f"input_ids[{i}][{j}]", f"token id {t} outside [0, {V})")
        sp = req.sampling
        if sp.max_new_tokens < 1:
            raise CacheOpError("sampling_params.max_new_tokens", "must be at least 1")
        tl = timeline([len(s) for s in req.segments], req.history)
        limit = self.cfg.max_position_embeddings
        peak = max(tl.max_position + 1, tl.next_pos + sp.max_new_tokens)
        if peak > limit:
            raise CacheOpError(
                "cache.reposition",
                f"context reaches position {peak}, past the model's limit of {limit}: "
                "add a reposition (after dropping messages) to bring positions down",
            )
        need = self._pages_bound(tl, sp.max_new_tokens, req.history)
        if need > self.num_pages:
            raise CacheOpError(
                "input_ids",
                f"request needs up to {need} KV pages, the pool has {self.num_pages}: "
                "raise --max-total-tokens",
            )
        return tl

    def _pages_bound(self, tl: Timeline, max_new: int, history: OpHistory) -> int:
        """Pages a request can hold at once: every segment (a node each, page-aligned), a
        compact copy of the tokens active at each repos, and its generated tokens."""
        ps = self.page_size
        pages = sum(-(-int(n) // ps) for n in tl.seg_lens) + -(-max_new // ps)
        for b in history.repos:
            pages += -(-len(tl.active_after(b)) // ps)
        return pages

    def add_request(self, req: GenerateRequest) -> None:
        tl = self.check(req)
        keys, tok_index, boundary = request_keys(req.segments, req.history)
        r = _Request(req, tl, keys, tok_index, boundary, time.monotonic())
        if req.sampling.seed is not None:
            r.rng = np.random.default_rng(req.sampling.seed)
        else:
            r.rng = np.random.default_rng()
        self.waiting.append(r)

    def abort(self, rid: str) -> None:
        for r in list(self.waiting):
            if r.rid == rid:
                self.waiting.remove(r)
        r = self.running.pop(rid, None)
        if r is not None:
            self._release(r, insert=False)
        r = self.prefilling.pop(rid, None)
        if r is not None:
            # Part of its KV is unwritten: the nodes it computes go back to evicted (a later
            # request recomputes them) before anyone may match them.
            for n in self._written_by(r):
                n.writer = None
                if n.pages is not None:
                    self.pool.free(n.pages)
                    n.pages = None
            self._release(r, insert=False)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def flush_cache(self) -> bool:
        if self.running or self.prefilling:
            return False
        self.tree.flush()
        return True

    def stats(self) -> dict:
        return dict(
            self.counters,
            evictions=self.tree.evictions,
            dead_evictions=self.tree.dead_evictions,
            pool_used_pages=self.pool.used_pages,
            pool_total_pages=self.num_pages,
            running=len(self.running) + len(self.prefilling),
            waiting=len(self.waiting),
        )

    def warm_up_shapes(self) -> int:
        """Run every step shape of the common path once, so no request pays for a compile
        (or, with the persistent cache, for tracing and loading one: ~0.7 s a shape for the
        tiny model): prefill forwards of each token bucket up to ``prefill_chunk`` and decode
        forwards of each row bucket up to ``max_running``, each at every view bucket up to
        the position limit (one segment per request, no repos). The dummy rows write to the
        sentinel slot (dropped) and see no KV, so the pool is untouched. Returns the number
        of shapes run."""
        ps = self.page_size
        sentinel = self.num_pages * ps
        views = _distinct_buckets(
            -(-self.cfg.max_position_embeddings // ps), lambda n: _view_bucket(n, ps)
        )

        def dummy(n_rows: int, n_pages: int) -> _Pass:
            return _Pass(
                tokens=[0] * n_rows,
                q_pos=[0] * n_rows,
                writes=[[(sentinel, 0)] for _ in range(n_rows)],
                segments=[SegmentSpec(q_start=0, q_len=n_rows, pages=[0] * n_pages,
                                      kv_visible=np.zeros(n_pages * ps, bool), causal_pos=0)],
                logits_row=n_rows - 1,
            )

        shapes = 0
        for n_pages in views:
            for n in _distinct_buckets(self.prefill_chunk,
                                       lambda n: _token_bucket(n, PREFILL_BLOCK_Q)):
                if n <= n_pages * ps:
                    p = dummy(n, n_pages)
                    jax.block_until_ready(self._run(self.prefill, [(None, p)], PREFILL_BLOCK_Q))
                    shapes += 1
            for rows in _distinct_buckets(self.max_running, lambda n: _token_bucket(n, 1)):
                work = [(None, dummy(1, n_pages)) for _ in range(rows)]
                jax.block_until_ready(self._run(self.decode, work, block_q=1))
                shapes += 1
        return shapes

    # ------------------------------------------------------------------ planning
    def _visible(self, tl: Timeline, toks, seg: int) -> np.ndarray:
        toks = np.asarray(toks, np.int64)
        ok = toks >= 0
        out = np.zeros(len(toks), bool)
        out[ok] = tl.drop_boundary[tl.token_seg[toks[ok]]] >= seg
        return out

    def _slot_tokens(self, node: Node) -> list[int]:
        """Absolute token index held in each slot of the node's pages (-1 for padding)."""
        toks = list(node.token_ids())
        n_pages = -(-len(toks) // self.page_size)
        return toks + [-1] * (n_pages * self.page_size - len(toks))

    def _view_pages(self, view: list[Node]) -> list[int]:
        """Pages of a view; an emptied node nothing here can see stands in as page 0 with
        every slot invisible (the planner guarantees nobody attends to it)."""
        out: list[int] = []
        for v in view:
            out += v.pages if v.pages is not None else [0] * self._node_pages_needed(v)
        return out

    def _node_pages_needed(self, node: Node) -> int:
        return -(-len(node.token_ids()) // self.page_size)

    def _build_path(self, r: _Request) -> tuple[list[Node], set[int]]:
        """Matched nodes plus fresh nodes for the rest of the keys; ids of fresh nodes."""
        path = self.tree.match(r.keys)
        i = sum(len(n.key) for n in path)
        parent = path[-1] if path else self.tree.root
        fresh: set[int] = set()
        tl = r.tl
        while i < len(r.keys):
            k = r.keys[i]
            if isinstance(k, int):
                # One node per segment: a rolling drop then empties whole nodes (a node that
                # also held the previous message's last token could never become dead).
                seg = tl.token_seg[r.tok_index[i]]
                j = i
                while (
                    j < len(r.keys)
                    and isinstance(r.keys[j], int)
                    and tl.token_seg[r.tok_index[j]] == seg
                ):
                    j += 1
                node = self.tree.add_child(parent, tuple(r.keys[i:j]), "tokens", r.tok_index[i])
                i = j
            else:
                node = self.tree.add_child(parent, (k,), k[0])
                if k[0] == "repos":  # it will hold copies of the tokens active there
                    node.held_tokens = tuple(tl.active_after(r.key_boundary[i]).tolist())
                i += 1
            fresh.add(node.id)
            path.append(node)
            parent = node
        # The last prompt token's logits must be computed even on a full match; split a
        # resident last token node so that only its last page is recomputed.
        k = max(i for i, n in enumerate(path) if n.kind == "tokens")
        last = path[k]
        cut = ((len(last.key) - 1) // self.page_size) * self.page_size
        if last.id not in fresh and cut > 0:
            path[k : k + 1] = [self.tree.split(last, cut), last]
        return path, fresh

    def _choose_compute(
        self, r: _Request, path: list[Node], fresh: set[int]
    ) -> tuple[set[int], set[int]]:
        """``(compute, needed)``: nodes to compute (fresh ones, the last token node, and, to a
        fixpoint, every emptied node whose KV something computed, or the final view, still
        attends to) and the nodes whose KV the pass or the final view reads."""
        tl = r.tl
        compute = {n.id for n in path if n.id in fresh and n.kind != "drop"}
        last_tok = next(n for n in reversed(path) if n.kind == "tokens")
        compute.add(last_tok.id)
        while True:
            needed: set[int] = set()
            view: list[Node] = []
            for node in path:
                if node.kind == "tokens":
                    if node.id in compute:
                        s = int(tl.token_seg[node.tok_start])
                        needed |= {v.id for v in view if self._visible(tl, v.token_ids(), s).any()}
                    view.append(node)
                elif node.kind == "repos":
                    if node.id in compute:
                        held = set(node.held_tokens)
                        needed |= {v.id for v in view if held & set(v.token_ids())}
                    view = [node]
            needed |= {v.id for v in view if tl.final_active[list(v.token_ids())].any()}
            extra = {n.id for n in path if n.id in needed and n.evicted} - compute
            if not extra:
                return compute, needed
            compute |= extra

    def _plan(self, r: _Request) -> _Pass | None:
        """Plan ``r``'s prefill pass, or None to retry next step (memory or dependencies)."""
        path, fresh = self._build_path(r)

        def give_up():
            for node in reversed(path):
                if node.id in fresh:
                    self.tree.remove(node)
            return None

        if any(n.busy_step == self._step_id or n.writer is not None for n in path):
            # Another request computes part of this path in this step, or in slices still to
            # run: its pages are not written yet (too late for this pass's pre-pass copies).
            return give_up()
        compute, needed = self._choose_compute(r, path, fresh)
        used = [n for n in path if n.id in compute or n.id in needed]
        # Pinned for this step: allocations below (and other requests' in this step) must
        # not evict KV this pass reads, even KV that is dead for every later request.
        self.tree.pinned.update(n.id for n in used)
        self.tree.touch(used)
        self.tree.lock(path[-1])
        allocated: list[tuple[Node, list[int]]] = []
        for node in path:
            if node.id in compute and node.pages is None:
                pages = self.tree.alloc(self._node_pages_needed(node))
                if pages is None:
                    for n, p in allocated:
                        self.pool.free(p)
                        n.pages = None
                    self.tree.unlock(path[-1])
                    return give_up()
                node.pages = pages
                allocated.append((node, pages))
        was_evicted = {n.id for n, _ in allocated if n.id not in fresh}
        if was_evicted:
            self.counters["restores"] += 1
            self.counters["restored_tokens"] += sum(
                len(n.token_ids()) for n in path if n.id in was_evicted
            )
        for n in path:
            if n.id in compute:
                n.writer = r.rid  # until the step of its last slice (see step())
        p = self._lay_out(r, path, compute)
        p.written_pages = [pg for n in path if n.id in compute for pg in n.pages]
        return p

    def _lay_out(self, r: _Request, path: list[Node], compute: set[int]) -> _Pass:
        tl, ps = r.tl, self.page_size
        p = _Pass()
        pass_row: dict[int, int] = {}  # abs token -> row in this pass
        src: dict[int, tuple[int, int]] = {}  # abs token -> (slot, pos) of a resident copy
        view: list[Node] = []
        epoch = 0
        cached = 0
        for node in path:
            if node.kind == "tokens":
                toks = node.token_ids()
                if node.pages is None:  # emptied and, by _choose_compute, never read here
                    # Dropped before anything computed now could see it: served by the cache
                    # state (nothing recomputes it), so it counts as cached, like reused KV.
                    cached += len(toks)
                    view.append(node)
                    continue
                slots = _slots(node.pages, len(node.key), ps)
                if node.id in compute:
                    seg = int(tl.token_seg[node.tok_start])
                    view_toks = [t for v in view for t in self._slot_tokens(v)]
                    visible = np.concatenate(
                        [self._visible(tl, view_toks, seg), np.ones(len(toks), bool)]
                    )
                    p.segments.append(
                        SegmentSpec(
                            q_start=len(p.tokens),
                            q_len=len(toks),
                            pages=self._view_pages(view) + list(node.pages),
                            kv_visible=visible,
                            causal_pos=len(view_toks),
                        )
                    )
                    for t, tid, sl in zip(toks, node.key, slots, strict=True):
                        pass_row[t] = len(p.tokens)
                        p.tokens.append(tid)
                        p.q_pos.append(int(tl.append_pos[t]))
                        p.writes.append([(sl, int(tl.append_pos[t]))])
                    src.update({t: None for t in toks})
                else:
                    cached += len(toks)
                    pos = tl.version_pos[epoch]
                    src.update({t: (sl, int(pos[t])) for t, sl in zip(toks, slots, strict=True)})
                view.append(node)
            elif node.kind == "repos":
                epoch += 1
                held = node.held_tokens
                view = [node]
                if node.pages is None:  # emptied and unread: later versions come after it
                    src = {}
                    continue
                slots = _slots(node.pages, len(held), ps)
                if node.id in compute:
                    for t, sl in zip(held, slots, strict=True):
                        new_pos = int(tl.version_pos[epoch][t])
                        if src.get(t) is None and t in pass_row:
                            p.writes[pass_row[t]].append((sl, new_pos))
                        else:
                            old_slot, old_pos = src[t]
                            p.copies.append((old_slot, sl, old_pos, new_pos))
                # Later copies start from this version only when it is resident already;
                # otherwise they keep using the older resident copy or the pass's write.
                if node.id not in compute:
                    pos = tl.version_pos[epoch]
                    src = {t: (sl, int(pos[t])) for t, sl in zip(held, slots, strict=True)}
                else:
                    src = {t: src.get(t) for t in held}
        last_tok = next(n for n in reversed(path) if n.kind == "tokens")
        p.logits_row = pass_row[last_tok.tok_start + len(last_tok.key) - 1]
        r.view_pages = self._view_pages(view)
        r.view_nodes = [v for v in view if r.tl.final_active[list(v.token_ids())].any()]
        r.view_toks = np.asarray([t for v in view for t in self._slot_tokens(v)], np.int64)
        r.last_node = path[-1]
        r.prompt_last_node = path[-1]
        r.cached_tokens = cached
        return p

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[TokenEvent]:
        self._step_id += 1
        self.tree.pinned.clear()
        # Prefill slices, at most ``prefill_chunk`` rows in all: first the passes already
        # under way (oldest first), then newly admitted requests.
        slices: list[tuple[_Request, _Pass]] = []
        budget = self.prefill_chunk
        for r in self.prefilling.values():
            # Its whole path stays pinned until the last slice: dead KV that later rows
            # still read must not be evicted by this step's allocations.
            self.tree.pinned.update(n.id for n in self.tree.path_to(r.last_node))
            if budget > 0:
                budget -= self._take_slice(r, budget, slices)
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.prefilling) < self.max_running
        ):
            r = self.waiting[0]
            p = self._plan(r)
            if p is None:
                break
            self.waiting.popleft()
            r.prefill, r.prefill_done, r.status = p, 0, "prefill"
            self.prefilling[r.rid] = r
            self.counters["cache_queries"] += 1
            self.counters["cache_query_tokens"] += r.tl.num_tokens
            self.counters["cache_hit_tokens"] += r.cached_tokens
            budget -= self._take_slice(r, budget, slices)
        decoders = [r for r in self.running.values() if r.status == "decode"]
        events: list[TokenEvent] = []
        decode_pass: list[tuple[_Request, _Pass]] = []
        stalled: list[_Request] = []
        for r in decoders:
            dp = self._decode_pass(r)
            if dp is None:  # no free page for its next token: wait for others to finish
                stalled.append(r)
                continue
            decode_pass.append((r, dp))
        if stalled and not decode_pass and not slices:
            # Nobody else can free pages: only then give up on the stalled requests.
            events.extend(self._finish(r, "abort") for r in stalled)
        if not slices and not decode_pass:
            return events
        # Prefill slices and decode rows run as two forwards, as SGLang runs prefill and
        # decode batches: a prefill wants wide query blocks, a decode row one query, and one
        # block size for both would pad every decode row to a prefill block. Disaggregated,
        # they run on their own groups (a finished prefill's pages are handed over first),
        # and both are dispatched before either result is read, so they overlap.
        parts = []
        if slices:
            parts.append(self._run(self.prefill, slices, block_q=PREFILL_BLOCK_Q))
            if self.prefill is not self.decode:
                done = [r for r, sl in slices if sl.logits_row >= 0]
                written = [pg for r in done for pg in r.prefill.written_pages]
                transfer_pages(self.prefill, self.decode, written)
        if decode_pass:
            parts.append(self._run(self.decode, decode_pass, block_q=1))
        logits = [np.asarray(row) for part in parts for row in np.asarray(part)]
        with_logits = [r for r, p in slices + decode_pass if p.logits_row >= 0]
        for r, row in zip(with_logits, logits, strict=True):
            if r.status == "prefill":
                self._prefill_done(r)
            events.extend(self._sample(r, row))
        return events

    def _take_slice(self, r: _Request, budget: int, slices: list) -> int:
        """Queue the next slice (at most ``budget`` rows) of ``r``'s pass; rows taken."""
        p, a = r.prefill, r.prefill_done
        b = min(len(p.tokens), a + budget)
        slices.append((r, p.slice(a, b)))
        r.prefill_done = b
        if b == len(p.tokens):
            # The last slice holds the logits row (the last row: the last token node's last
            # token), which is how step() sees the prefill end.
            assert p.logits_row >= a
            # Its nodes are written by the end of this step's forward: from the next step on
            # other requests may read them (this step's plans must still wait).
            for n in self._written_by(r):
                n.writer = None
                n.busy_step = self._step_id
        return b - a

    def _written_by(self, r: _Request) -> list[Node]:
        """Nodes on ``r``'s path whose KV its unfinished prefill writes (split-off upper
        parts included: a split copies ``writer``)."""
        return [n for n in self.tree.path_to(r.last_node) if n.writer == r.rid]

    def _prefill_done(self, r: _Request) -> None:
        del self.prefilling[r.rid]
        r.prefill = None
        r.status = "decode"
        self.running[r.rid] = r

    def _decode_pass(self, r: _Request) -> _Pass | None:
        ps = self.page_size
        j = len(r.generated) - 1  # index of the token being fed
        if j // ps >= len(r.gen_pages):
            pages = self.tree.alloc(1)
            if pages is None:
                return None
            r.gen_pages.extend(pages)
        tl = r.tl
        toks = r.view_toks
        vis = toks >= 0
        vis[vis] = tl.final_active[toks[vis]]
        gen_vis = np.arange(len(r.gen_pages) * ps) <= j
        slot = r.gen_pages[j // ps] * ps + j % ps
        pos = tl.next_pos + j
        p = _Pass(
            tokens=[r.generated[-1]],
            q_pos=[pos],
            writes=[[(slot, pos)]],
            segments=[
                SegmentSpec(
                    q_start=0,
                    q_len=1,
                    pages=r.view_pages + r.gen_pages,
                    kv_visible=np.concatenate([vis, gen_vis]),
                    causal_pos=len(toks) + j,
                )
            ],
            logits_row=0,
        )
        return p

    def _run(self, group: DeviceGroup, work: list[tuple[_Request, _Pass]], block_q: int):
        """Dispatch one forward over ``work`` on ``group``; returns its logits rows (lazy)."""
        ps = self.page_size
        tokens, q_pos, writes, segs, copies, rows = [], [], [], [], [], []
        for _, p in work:
            off = len(tokens)
            tokens += p.tokens
            q_pos += p.q_pos
            writes += p.writes
            segs += [dataclasses.replace(s, q_start=s.q_start + off) for s in p.segments]
            copies += p.copies
            if p.logits_row >= 0:
                rows.append(off + p.logits_row)
        if copies:
            group.rerotate_copy(copies, self.rope)
        # Padded to few shapes (see _token_bucket); the block count follows from the token
        # count (each segment adds at most one partial block).
        T = _token_bucket(len(tokens), block_q)
        W = bucket(max(len(w) for w in writes), 1 if block_q == 1 else 4)
        sentinel = self.num_pages * ps
        slot_arr = np.full((W, T), sentinel, np.int32)
        pos_arr = np.zeros((W, T), np.int32)
        for t, ws in enumerate(writes):
            for w, (sl, pos) in enumerate(ws):
                slot_arr[w, t], pos_arr[w, t] = sl, pos
        tok_arr = np.zeros(T, np.int32)
        tok_arr[: len(tokens)] = tokens
        qp = np.zeros(T, np.int32)
        qp[: len(q_pos)] = q_pos
        ns = bucket(len(segs), 8)
        batch = build_segment_batch(
            segs,
            page_size=ps,
            block_q=block_q,
            num_blocks=T if block_q == 1 else T // block_q + ns,
            num_segments=ns,
            max_pages=_view_bucket(max(len(s.pages) for s in segs), ps),
        )
        row_arr = np.zeros(bucket(len(rows), 8), np.int32)
        row_arr[: len(rows)] = rows
        writes_arr = KVWrites(slots=jnp.asarray(slot_arr), positions=jnp.asarray(pos_arr))
        logits = group.forward(
            tok_arr, qp, writes_arr, batch, self.rope, self._attn[block_q], row_arr
        )
        return logits[: len(rows)]

    # ------------------------------------------------------------------ sampling
    def _sample(self, r: _Request, logits: np.ndarray) -> list[TokenEvent]:
        sp = r.req.sampling
        logits = logits.astype(np.float64)
        logprobs = logits - _logsumexp(logits)
        if sp.temperature <= 0:
            tok = int(np.argmax(logits))
        else:
            z = logits / sp.temperature
            if sp.top_k > 0:
                kth = np.partition(z, -sp.top_k)[-sp.top_k]
                z = np.where(z < kth, -np.inf, z)
            probs = np.exp(z - _logsumexp(z))
            if sp.top_p < 1.0:
                order = np.argsort(-probs)
                cum = np.cumsum(probs[order])
                cut = order[cum - probs[order] >= sp.top_p]
                probs[cut] = 0.0
                probs /= probs.sum()
            tok = int(r.rng.choice(len(probs), p=probs))
        r.generated.append(tok)
        lp = float(logprobs[tok]) if r.req.return_logprob else None
        reason = None
        if not sp.ignore_eos and tok in self.eos_ids:
            reason = "stop"
        elif tok in sp.stop_token_ids:
            reason = "stop"
        elif len(r.generated) >= sp.max_new_tokens:
            reason = "length"
        if reason is None:
            meta = self._meta(r) if len(r.generated) == 1 else {}
            return [TokenEvent(r.rid, tok, lp, False, None, meta)]
        ev = self._finish(r, reason)
        ev.token_id, ev.logprob = tok, lp
        return [ev]

    @staticmethod
    def _meta(r: _Request) -> dict:
        return dict(
            prompt_tokens=r.tl.num_tokens,
            cached_tokens=r.cached_tokens,
            active_tokens=int(r.tl.final_active.sum()) + len(r.generated),
        )

    def _finish(self, r: _Request, reason: str) -> TokenEvent:
        self.running.pop(r.rid, None)
        meta = dict(self._meta(r), completion_tokens=len(r.generated), finish_reason=reason)
        self._release(r, insert=True)
        self.counters["requests_finished"] += 1
        return TokenEvent(r.rid, -1, None, True, reason, meta)

    def _release(self, r: _Request, insert: bool) -> None:
        """Hand generated KV to the tree (the next turn reuses it) and unlock the path."""
        fed = r.generated[:-1]  # the last sampled token was never fed, so has no KV
        pages = r.gen_pages
        r.gen_pages = []
        if insert and fed and r.prompt_last_node is not None:
            keep = -(-len(fed) // self.page_size)
            transfer_pages(self.decode, self.prefill, pages[:keep])
            node = self.tree.add_child(
                r.prompt_last_node, tuple(fed), "tokens", tok_start=r.tl.num_tokens
            )
            node.pages = pages[:keep]
            pages = pages[keep:]
        if pages:
            self.pool.free(pages)
        self.tree.touch(r.view_nodes)  # the next turn attends to these again
        r.view_nodes = []
        if r.last_node is not None:
            self.tree.unlock(r.last_node)
            r.last_node = None
        r.status = "done"


def _slots(pages: list[int], n: int, page_size: int) -> list[int]:
    return [pages[i // page_size] * page_size + i % page_size for i in range(n)]


def _logsumexp(x: np.ndarray) -> float:
    m = np.max(x)
    return float(m + np.log(np.sum(np.exp(x - m))))


class AsyncEngine:
    """Runs :meth:`Engine.step` on one background thread; requests stream TokenEvents."""

    def __init__(self, engine: Engine, lockstep: bool = False):
        """``lockstep``: this is process 0 of a multi-host run (see multihost.py): every
        command and step is broadcast to the follower processes."""
        self.engine = engine
        self.lockstep = lockstep
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="akv-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call(self, fn, *args, timeout: float = 120.0):
        """Run ``fn(engine, *args)`` on the engine thread and wait for its result.

        For inspection only: in a multi-host run it is not replicated to the followers
        (state changes go through :meth:`call_method`)."""
        return self._wait("call", (fn, args), timeout)

    def call_method(self, name: str, *args, timeout: float = 120.0):
        """Run ``engine.<name>(*args)`` on the engine thread (replicated across hosts)."""
        return self._wait("method", (name, args), timeout)

    def flush_cache(self) -> bool:
        return self.call_method("flush_cache")

    def _wait(self, kind: str, what: tuple, timeout: float):
        done = threading.Event()
        box: dict = {}
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        self._inbox.put((kind, (*what, box, done)))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError(f"engine did not answer within {timeout} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[req.rid] = (loop, q)
        finished = False
        try:
            # Validation errors (Engine.check, run again by add_request on the engine thread)
            # come back through the stream as exceptions.
            self._inbox.put(("add", req))
            self._wake.set()
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(req.rid, None)
            if not finished:  # the client went away: free the request's pages
                self._inbox.put(("abort", req.rid))
                self._wake.set()

    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _loop(self) -> None:
        eng = self.engine
        last_sync = time.monotonic()
        while not self._stop.is_set():
            commands: list[tuple] = []
            waiters: list[tuple[int, dict, threading.Event]] = []
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    if self.lockstep and payload.sampling.seed is None:
                        # Every process samples; they must draw the same numbers.
                        seed = int(np.random.default_rng().integers(2**31))
                        sampling = dataclasses.replace(payload.sampling, seed=seed)
                        payload = dataclasses.replace(payload, sampling=sampling)
                    commands.append(("add", payload))
                elif kind == "abort":
                    commands.append(("abort", payload))
                elif kind == "method":
                    name, args, box, done = payload
                    waiters.append((len(commands), box, done))
                    commands.append(("method", (name, args)))
                elif kind == "call":  # read-only inspection, never replicated
                    fn, args, box, done = payload
                    try:
                        box["value"] = fn(eng, *args)
                    except Exception as e:
                        box["error"] = e
                    done.set()
            results = apply_commands(eng, commands)
            for (kind, payload), (_, res) in zip(commands, results, strict=True):
                if kind == "add" and isinstance(res, BaseException):
                    self._deliver(payload.rid, res)
            for i, box, done in waiters:
                res = results[i][1]
                box["error" if isinstance(res, BaseException) else "value"] = res
                done.set()
            do_step = eng.has_work()
            if self.lockstep and (commands or do_step or time.monotonic() - last_sync > 1.0):
                broadcast_object((commands, do_step))
                last_sync = time.monotonic()
            if not do_step:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                events = eng.step()
            except Exception as e:  # never leave a client hanging on an engine fault
                for rid in [*eng.running, *eng.prefilling, *(r.rid for r in eng.waiting)]:
                    self._deliver(rid, RuntimeError(f"engine error: {e}"))
                    eng.abort(rid)
                continue
            for ev in events:
                self._deliver(ev.rid, ev)
        if self.lockstep:
            broadcast_object(STOP)

    def next_rid(self) -> str:
        return f"req-{next(self._ids)}"
