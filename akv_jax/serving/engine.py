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

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable

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
from akv_jax.serving.multihost import MultihostError, digest, is_peer_loss, peer_failure
from akv_jax.serving.page_pool import PagePool
from akv_jax.serving.radix import Node, RadixTree, request_keys
from akv_jax.serving.sampler import invalid_param, make_rng, sample
from akv_jax.serving.types import GenerateRequest, TokenEvent, describe_error

log = logging.getLogger("akv_jax.serving")


class PoolTooSmall(RuntimeError):
    """A request that can never fit the KV pool as its prefix is stored."""


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
            requests_failed=0,
        )
        self.prefilling: dict[str, _Request] = {}  # admitted, prefill slices still to run
        self._step_id = 0
        # Multi-host: called once per step, before any forward, with a digest of what this
        # process is about to run; raises if the processes disagree (see multihost.py).
        self.replica_check: Callable[[int, bytes], None] | None = None
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
        bad = invalid_param(sp)
        if bad is not None:
            raise CacheOpError(f"sampling_params.{bad[0]}", bad[1])
        if sp.seed is not None and (isinstance(sp.seed, bool) or not isinstance(sp.seed, int)):
            raise CacheOpError("sampling_params.seed", f"{sp.seed!r} is not an integer")
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
        r.rng = make_rng(req.sampling.seed)
        self.waiting.append(r)

    def abort(self, rid: str) -> None:
        for r in [*(q for q in self.waiting if q.rid == rid), self.running.get(rid),
                  self.prefilling.get(rid)]:
            if r is not None:
                self._drop(r)

    def _drop(self, r: _Request) -> None:
        """Take ``r`` out of the scheduler and release what it holds (pages, locks)."""
        for i, q in enumerate(self.waiting):
            if q is r:
                del self.waiting[i]
                break
        if self.running.get(r.rid) is r:
            del self.running[r.rid]
        if self.prefilling.get(r.rid) is r:
            del self.prefilling[r.rid]
            # Part of its KV is unwritten: back to evicted before anyone may match it.
            self._unwrite(self._written_by(r))
        if r.gen_pages or r.last_node is not None:
            self._release(r, insert=False)
        r.status = "done"

    def _unwrite(self, nodes: list[Node]) -> None:
        """Nodes whose KV was never written go back to evicted (a later request recomputes
        them) and lose their writer."""
        for n in nodes:
            n.writer = None
            if n.pages is not None:
                self.pool.free(n.pages)
                n.pages = None

    def fail(self, rid: str, message: str) -> TokenEvent | None:
        """End request ``rid`` with an error event (None if it is not queued or running).

        Multi-host followers apply this when the leader reports a request it failed."""
        r = self.running.get(rid) or self.prefilling.get(rid)
        r = r or next((q for q in self.waiting if q.rid == rid), None)
        return None if r is None else self._fail(r, message)

    def _fail(self, r: _Request, message: str, kv_unwritten: bool = False) -> TokenEvent:
        """End ``r`` with an error event, releasing what it holds as an abort does.

        ``kv_unwritten``: the forward that was to write its prefill did not run, so every
        node its pass computes (written_pages) goes back to evicted, last slice included
        (``_take_slice`` has already published those nodes as written)."""
        meta = dict(self._meta(r), completion_tokens=len(r.generated), finish_reason="error")
        if kv_unwritten and r.prefill is not None and r.last_node is not None:
            mine = set(r.prefill.written_pages)
            self._unwrite([n for n in self.tree.path_to(r.last_node)
                           if n.pages and mine.intersection(n.pages)])
        self._drop(r)
        self.counters["requests_failed"] += 1
        return TokenEvent(r.rid, -1, None, True, "error", meta, error=message)

    def _failed(self, r: _Request, e: Exception, where: str, kv_unwritten: bool = False):
        """``_fail`` for an exception raised by ``r``'s own work; the traceback goes to the
        log, a one-line message to the client."""
        log.error("request %s failed in %s", r.rid, where, exc_info=e)
        return self._fail(r, f"engine error ({where}): {describe_error(e)}", kv_unwritten)

    def _unplan(self, r: _Request, mark: int) -> None:
        """Undo what a ``_plan(r)`` that raised may have left behind (it plans in place):
        nodes it marked for writing go back to evicted (nothing wrote them), a lock it took
        is released, and the childless empty nodes it added (ids above ``mark``) are
        removed. Split nodes stay: a split changes no match."""
        self._unwrite([n for n in self.tree.nodes() if n.writer == r.rid])
        # Every live request holds one lock, on its last node; any other is r's.
        held: dict[int, int] = {}
        for q in (*self.running.values(), *self.prefilling.values()):
            if q.last_node is not None:
                held[id(q.last_node)] = held.get(id(q.last_node), 0) + 1
        new: list[Node] = []
        for n in list(self.tree.nodes()):
            for _ in range(n.ends - held.get(id(n), 0)):
                self.tree.unlock(n)
            if n.kind != "root" and n.id > mark:
                new.append(n)
        for n in sorted(new, key=lambda n: -n.id):  # a fresh chain's leaf is its newest node
            if not n.children and n.pages is None and n.lock == 0 and n.ends == 0:
                self.tree.remove(n)
        r.last_node = r.prompt_last_node = None
        r.view_nodes, r.view_pages, r.view_toks = [], [], None

    def reset(self, message: str) -> list[TokenEvent]:
        """Fail every request and start over from an empty cache (a fresh pool and tree).

        The answer to a fault outside any one request's work, after which the tree's
        bookkeeping cannot be trusted; the device KV needs no clearing (no page is owned)."""
        reqs = [*self.waiting, *self.prefilling.values(), *self.running.values()]
        meta = {"finish_reason": "error"}
        events = [TokenEvent(r.rid, -1, None, True, "error", meta, error=message) for r in reqs]
        self.waiting.clear()
        self.prefilling.clear()
        self.running.clear()
        old = self.tree
        self.pool = PagePool(self.num_pages)
        self.tree = RadixTree(self.pool, self.page_size)
        self.tree.evictions, self.tree.dead_evictions = old.evictions, old.dead_evictions
        self.counters["requests_failed"] += len(reqs)
        return events

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
        # check() bounds a request's pages by its own segments, but a stored prefix split at
        # other requests' message boundaries can take more pages (a node each, page-aligned).
        holds = sum(self._node_pages_needed(n) for n in used if n.kind != "drop")
        holds += -(-r.req.sampling.max_new_tokens // self.page_size)
        if holds > self.num_pages:
            give_up()
            raise PoolTooSmall(
                f"this request needs {holds} KV pages at once (its prefix is stored split at "
                f"other requests' message boundaries); the pool has {self.num_pages}: raise "
                "--max-total-tokens"
            )
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
        """One scheduler step. An exception in one request's own work (planning it, its
        prefill slice or decode row, sampling or finishing it) fails that request only: it
        ends with an error event, its pages and locks are released, and the step goes on
        for the others. A forward that raises fails the requests whose rows it carries."""
        self._step_id += 1
        self.tree.pinned.clear()
        events: list[TokenEvent] = []

        def drop_slice(r: _Request) -> None:
            slices[:] = [(q, sl) for q, sl in slices if q is not r]

        # Prefill slices, at most ``prefill_chunk`` rows in all: first the passes already
        # under way (oldest first), then newly admitted requests.
        slices: list[tuple[_Request, _Pass]] = []
        budget = self.prefill_chunk
        for r in list(self.prefilling.values()):
            try:
                # Its whole path stays pinned until the last slice: dead KV that later rows
                # still read must not be evicted by this step's allocations.
                self.tree.pinned.update(n.id for n in self.tree.path_to(r.last_node))
                if budget > 0:
                    budget -= self._take_slice(r, budget, slices)
            except Exception as e:
                drop_slice(r)
                events.append(self._failed(r, e, "prefill", kv_unwritten=True))
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.prefilling) < self.max_running
        ):
            r = self.waiting[0]
            mark = _node_watermark()
            try:
                p = self._plan(r)
            except PoolTooSmall as e:  # a clear answer, not a fault: nothing to log
                self._unplan(r, mark)
                events.append(self._fail(r, str(e)))
                continue
            except Exception as e:
                self._unplan(r, mark)
                events.append(self._failed(r, e, "planning"))
                continue
            if p is None:
                break
            self.waiting.popleft()
            r.prefill, r.prefill_done, r.status = p, 0, "prefill"
            self.prefilling[r.rid] = r
            self.counters["cache_queries"] += 1
            self.counters["cache_query_tokens"] += r.tl.num_tokens
            self.counters["cache_hit_tokens"] += r.cached_tokens
            try:
                budget -= self._take_slice(r, budget, slices)
            except Exception as e:
                drop_slice(r)
                events.append(self._failed(r, e, "prefill", kv_unwritten=True))
        decoders = [r for r in self.running.values() if r.status == "decode"]
        decode_pass: list[tuple[_Request, _Pass]] = []
        stalled: list[_Request] = []
        for r in decoders:
            try:
                dp = self._decode_pass(r)
            except Exception as e:
                events.append(self._failed(r, e, "decode"))
                continue
            if dp is None:  # no free page for its next token: wait for others to finish
                stalled.append(r)
                continue
            decode_pass.append((r, dp))
        if stalled and not decode_pass and not slices:
            # Nobody else can free pages: fail the youngest stalled request (its pages go back
            # to the pool) so that the others can go on; never end one silently short.
            r = max(stalled, key=lambda q: q.arrival)
            events.append(self._fail(r, (
                f"the KV pool ({self.num_pages} pages) is full: {len(stalled)} decoding "
                "requests hold every page; raise --max-total-tokens"
            )))
        if self.replica_check is not None:
            # Multi-host: every process must run the same forwards on the same state.
            self.replica_check(self._step_id, self._digest(slices, decode_pass))
        if not slices and not decode_pass:
            return events
        # Prefill slices and decode rows run as two forwards, as SGLang runs prefill and
        # decode batches: a prefill wants wide query blocks, a decode row one query, and one
        # block size for both would pad every decode row to a prefill block. Disaggregated,
        # they run on their own groups (a finished prefill's pages are handed over first),
        # and both are dispatched before either result is read, so they overlap.
        parts: list[tuple[str, list[tuple[_Request, _Pass]], jax.Array]] = []
        if slices:
            try:
                out = self._run(self.prefill, slices, block_q=PREFILL_BLOCK_Q)
                if self.prefill is not self.decode:
                    done = [r for r, sl in slices if sl.logits_row >= 0]
                    written = [pg for r in done for pg in r.prefill.written_pages]
                    transfer_pages(self.prefill, self.decode, written)
                parts.append(("prefill", slices, out))
            except Exception as e:
                events.extend(self._forward_failed(slices, e, "prefill"))
        if decode_pass:
            try:
                parts.append(("decode", decode_pass, self._run(self.decode, decode_pass, 1)))
            except Exception as e:
                events.extend(self._forward_failed(decode_pass, e, "decode"))
        results = []
        for what, work, out in parts:
            try:
                results.append((work, np.asarray(out)))  # a failed dispatch surfaces here
            except Exception as e:
                events.extend(self._forward_failed(work, e, what))
        for work, logits in results:
            with_logits = [r for r, p in work if p.logits_row >= 0]
            for r, row in zip(with_logits, logits, strict=True):
                try:
                    if r.status == "prefill":
                        self._prefill_done(r)
                    events.extend(self._sample(r, np.asarray(row)))
                except Exception as e:
                    events.append(self._failed(r, e, "sampling"))
        return events

    def _forward_failed(
        self, work: list[tuple[_Request, _Pass]], e: Exception, what: str
    ) -> list[TokenEvent]:
        """Fail the requests whose rows a forward that raised carried."""
        if jax.process_count() > 1:
            # Its collectives may have run on some processes and not on others: no process
            # can tell what the others' engines or KV hold any more.
            if is_peer_loss(e):
                raise peer_failure(e) from e
            raise MultihostError(f"the {what} forward failed: {describe_error(e)}") from e
        log.error("the %s forward failed; failing its %d requests", what, len(work), exc_info=e)
        msg = f"engine error ({what} forward): {describe_error(e)}"
        return [self._fail(r, msg, kv_unwritten=True) for r, _ in work]

    def _digest(self, slices: list, decode_pass: list) -> bytes:
        """What this step runs and the state it runs on, hashed (the same on every process
        of a multi-host run unless their engines have diverged)."""
        state = (
            [(r.rid, len(p.tokens), p.logits_row) for r, p in slices],
            [r.rid for r, _ in decode_pass],
            self.pool.used_pages,
            [r.rid for r in self.waiting],
            sorted(self.running),
            sorted(self.prefilling),
        )
        return digest(state)

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
        """Sample ``r``'s next token (math in sampler.py) and decide whether it finishes."""
        sp = r.req.sampling
        tok, logprob = sample(logits, sp, r.rng)
        r.generated.append(tok)
        lp = logprob if r.req.return_logprob else None
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


def _node_watermark() -> int:
    """An id above every node made so far (radix node ids come from one rising counter)."""
    return Node((), "root", None).id


def _slots(pages: list[int], n: int, page_size: int) -> list[int]:
    return [pages[i // page_size] * page_size + i % page_size for i in range(n)]
