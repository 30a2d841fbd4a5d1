"""The serving engine: the scheduler that admits requests, plans them, runs one prefill and
one decode forward per step over every request's work, and samples.

Request life cycle:

1. ``add_request`` validates and queues. The request's history is flattened into radix keys
   (tokens and op items, ``radix.request_keys``) and its :class:`Timeline` says, for every
   token, its positions in every version and which segments see it.
2. Prefill, planned as **one pass** per request (``planner.py``). The pass runs in slices
   of at most ``prefill_chunk`` rows over consecutive steps (chunked prefill), so a long
   prompt never stalls running decodes for more than one slice; rows only read KV of
   earlier rows, which earlier slices have written.
3. Decode: one token per running request per step, its view the request's final version.
   When a decode row finds no free page, the youngest decoding request is *preempted*: its
   generated KV becomes a token node (as at finish), its path is unlocked, so eviction may
   spill all of it to the host tier, and it waits at the head of the queue to resume as its
   prompt plus the tokens it had fed: a prefill that reloads (or, if the host tier lost it,
   recomputes) that state exactly, samples nothing, and decoding goes on where it stopped.
4. Finish: generated tokens become a token node, the path is unlocked.

Admission (memory): a plan allocates without evicting KV that running requests read (locks)
or, while others run, live KV used in the last ``admission_window_s`` that would be lost
(with a host tier, evicted live KV is spilled, not lost); otherwise it waits, at most
``admission_max_wait_s``. A sliced prefill keeps pinned only the KV its remaining rows read,
so dead KV that only earlier rows read is freed as soon as they have run.

Who does what: ``cache_manager.py`` owns the radix tree and the page pool; ``planner.py``
decides what a request computes and lays out its rows; ``executor.py`` packs passes into
bucketed device arrays and runs the forwards; ``sampler.py`` picks tokens;
``admission.py`` checks a request before it queues. This module holds the queues and the
request life cycle, all host-side bookkeeping. (It is a little over 400 lines because every
way a request ends, normally or by a fault in any stage, is stated here beside the stage;
split apart, the release rules would be scattered over modules.)
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable

import jax
import numpy as np

from akv_jax.cache.ops import OpHistory
from akv_jax.cache.timeline import Timeline, timeline
from akv_jax.serving.admission import check_request
from akv_jax.serving.cache_manager import CacheManager
from akv_jax.serving.constrained_rows import MaskedGreedy
from akv_jax.serving.executor import Executor
from akv_jax.serving.multihost import MultihostError, digest, is_peer_loss, peer_failure
from akv_jax.serving.planner import Planner, PoolTooSmall
from akv_jax.serving.radix import RequestKeys
from akv_jax.serving.sampler import invalid_param, log_softmax, make_rng, sample
from akv_jax.serving.types import GenerateRequest, TokenEvent, describe_error
from akv_jax.serving.work import Pass, RequestState

log = logging.getLogger("akv_jax.serving")

__all__ = ["Engine", "PoolTooSmall"]

Work = list[tuple[RequestState, Pass]]


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
        host_kv_tokens: int | None = None,
        admission_window_s: float = 10.0,
        admission_max_wait_s: float = 2.0,
        jump_forward: bool = True,
    ):
        """``tp``: tensor-parallel degree of the (colocated) device group.
        ``disaggregate=(P, D)``: prefill and restores on the first P devices, decode on the
        next D (each group tensor-parallel over its devices), KV pages handed between them.
        ``host_kv_tokens``: the host tier's size (None: four times the device pool; 0: no
        host tier; always none across several processes, whose host memories differ).
        ``admission_window_s`` / ``admission_max_wait_s``: see the module docstring.
        ``jump_forward``: feed the tokens a request's grammar forces in one decode pass
        instead of a step each (the same tokens either way: a forced token is the only one
        its grammar allows)."""
        self.cfg = model.cfg
        tok = getattr(model, "tokenizer", None)
        self.eos_ids = set(model.cfg.eos_token_ids) | set(getattr(tok, "eos_ids", ()) or ())
        self.page_size = page_size
        self.num_pages = max(2, -(-max_total_tokens // page_size))
        if host_kv_tokens is None:
            host_kv_tokens = 4 * self.num_pages * page_size
        if host_kv_tokens < 0:
            raise ValueError(f"host_kv_tokens={host_kv_tokens}: must be at least 0")
        self.num_host_pages = -(-host_kv_tokens // page_size) if jax.process_count() == 1 else 0
        self.executor = Executor(
            self.cfg, model.params, num_pages=self.num_pages, page_size=page_size,
            kv_dtype=kv_dtype or model.params.embed.dtype, attention_backend=attention_backend,
            tp=tp, disaggregate=disaggregate, devices=devices, host_pages=self.num_host_pages,
        )
        self.cache = CacheManager(self.num_pages, page_size, self.num_host_pages,
                                  self.executor if self.num_host_pages else None)
        self.admission_window_s = admission_window_s
        self.admission_max_wait_s = admission_max_wait_s
        self.planner = Planner(self.cache)
        self.backend = attention_backend
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.jump_forward = jump_forward
        # Multi-host: called once per step, before any forward, with a digest of what this
        # process is about to run; raises if the processes disagree (see multihost.py).
        self.replica_check: Callable[[int, bytes], None] | None = None
        self.waiting: deque[RequestState] = deque()
        self.prefilling: dict[str, RequestState] = {}  # admitted, prefill slices still to run
        self.running: dict[str, RequestState] = {}  # decoding
        self.counters = dict(
            cache_queries=0,
            cache_query_tokens=0,
            cache_hit_tokens=0,
            restores=0,
            restored_tokens=0,
            requests_finished=0,
            requests_failed=0,
            preemptions=0,
            resumes=0,
            admission_waits=0,  # steps in which the head of the queue could not be planned
            admission_wait_seconds=0.0,  # queueing time of admitted requests, summed
        )
        self._step_id = 0

    # ------------------------------------------------------------------ admission
    def check(self, req: GenerateRequest) -> Timeline:
        """Validate what only the engine knows (vocabulary, position limit, pool size)."""
        return check_request(req, self.cfg, self.page_size, self.num_pages)

    def prepare(self, req: GenerateRequest) -> GenerateRequest:
        """``req`` checked, with its timeline and radix keys: pure, so the API calls it off
        the engine's thread and :meth:`add_request` has only to queue the result."""
        tl = self.check(req)
        return dataclasses.replace(req, prepared=(tl, RequestKeys.of(req.segments, req.history)))

    def add_request(self, req: GenerateRequest) -> None:
        if req.prepared is None:
            req = self.prepare(req)
        tl, keys = req.prepared
        r = RequestState(req, tl, keys, time.monotonic())
        r.rng = make_rng(req.sampling.seed)
        r.prompt_tokens = tl.num_tokens
        r.waiting_since = r.arrival
        self.waiting.append(r)

    # ------------------------------------------------------------------ ending requests
    def abort(self, rid: str) -> None:
        for r in [*(q for q in self.waiting if q.rid == rid), self.running.get(rid),
                  self.prefilling.get(rid)]:
            if r is not None:
                self._drop(r)

    def _drop(self, r: RequestState) -> None:
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
            self.cache.unwrite(self._written_by(r))
        if r.gen_pages or r.last_node is not None:
            self._release(r, insert=False)
        r.status = "done"

    def fail(self, rid: str, message: str) -> TokenEvent | None:
        """End request ``rid`` with an error event (None if it is not queued or running).

        Multi-host followers apply this when the leader reports a request it failed."""
        r = self.running.get(rid) or self.prefilling.get(rid)
        r = r or next((q for q in self.waiting if q.rid == rid), None)
        return None if r is None else self._fail(r, message)

    def _fail(self, r: RequestState, message: str, kv_unwritten: bool = False) -> TokenEvent:
        """End ``r`` with an error event, releasing what it holds as an abort does.

        ``kv_unwritten``: the forward that was to write its prefill did not run, so every
        node its pass computes (written_pages) goes back to evicted, last slice included
        (``_take_slice`` has already published those nodes as written)."""
        meta = dict(self._meta(r), completion_tokens=len(r.generated), finish_reason="error")
        if kv_unwritten and r.prefill is not None and r.last_node is not None:
            mine = set(r.prefill.written_pages)
            self.cache.unwrite([n for n in self.cache.path_to(r.last_node)
                                if n.pages and mine.intersection(n.pages)])
        self._drop(r)
        self.counters["requests_failed"] += 1
        return TokenEvent(r.rid, -1, None, True, "error", meta, error=message)

    def _failed(self, r: RequestState, e: Exception, where: str, kv_unwritten: bool = False):
        """``_fail`` for an exception raised by ``r``'s own work; the traceback goes to the
        log, a one-line message to the client."""
        log.error("request %s failed in %s", r.rid, where, exc_info=e)
        return self._fail(r, f"engine error ({where}): {describe_error(e)}", kv_unwritten)

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
        self.cache.reset()
        self.counters["requests_failed"] += len(reqs)
        return events

    # ------------------------------------------------------------------ state
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def flush_cache(self) -> bool:
        if self.running or self.prefilling:
            return False
        self.cache.flush()
        return True

    def stats(self) -> dict:
        return dict(
            self.counters,
            **self.cache.stats(),
            running=len(self.running) + len(self.prefilling),
            waiting=len(self.waiting),
        )

    def warm_up_shapes(self) -> int:
        """Compile every step shape of the common path (see Executor.warm_up_shapes)."""
        return self.executor.warm_up_shapes(self.prefill_chunk, self.max_running)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[TokenEvent]:
        """One scheduler step. An exception in one request's own work (planning it, its
        prefill slice or decode row, sampling or finishing it) fails that request only: it
        ends with an error event, its pages and locks are released, and the step goes on
        for the others. A forward that raises fails the requests whose rows it carries."""
        self._step_id += 1
        self.cache.new_step()
        events: list[TokenEvent] = []
        slices, budget = self._continue_prefills(events)
        self._admit(slices, budget, events)
        decode_pass = self._decode_rows(bool(slices), events)
        if self.replica_check is not None:
            # Multi-host: every process must run the same forwards on the same state.
            self.replica_check(self._step_id, self._digest(slices, decode_pass))
        if slices or decode_pass:
            events.extend(self._run(slices, decode_pass))
        return events

    def _continue_prefills(self, events: list[TokenEvent]) -> tuple[Work, int]:
        """The next slices of passes already under way, oldest first, within
        ``prefill_chunk`` rows; returns them and the rows left for new admissions."""
        slices: Work = []
        budget = self.prefill_chunk
        for r in list(self.prefilling.values()):
            try:
                # What its remaining rows read stays pinned until they have run: dead KV
                # they still read must not be evicted by this step's allocations; dead KV
                # only earlier slices read may go.
                self.cache.pin(self._still_read(r))
                if budget > 0:
                    budget -= self._take_slice(r, budget, slices)
            except Exception as e:
                slices[:] = [(q, sl) for q, sl in slices if q is not r]
                events.append(self._failed(r, e, "prefill", kv_unwritten=True))
        return slices, budget

    def _admit(self, slices: Work, budget: int, events: list[TokenEvent]) -> None:
        """Plan waiting requests in arrival order while rows and running slots last; each
        admitted request's first slice joins ``slices``."""
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.prefilling) < self.max_running
        ):
            r = self.waiting[0]
            cached = r.cached_tokens
            try:
                # Undone in the cache if it raises.
                p = self.planner.plan(r, self._step_id, self._keep_used_after(r))
            except Exception as e:
                if isinstance(e, PoolTooSmall):  # a clear answer, not a fault: nothing to log
                    events.append(self._fail(r, str(e)))
                else:
                    events.append(self._failed(r, e, "planning"))
                continue
            c = self.counters
            if p is None:
                c["admission_waits"] += 1
                break
            self.waiting.popleft()
            r.prefill, r.prefill_done, r.status = p, 0, "prefill"
            self.prefilling[r.rid] = r
            c["admission_wait_seconds"] += time.monotonic() - r.waiting_since
            if r.resumed:  # its usage figures are its first admission's
                r.cached_tokens = cached
                c["resumes"] += 1
            else:
                c["cache_queries"] += 1
                c["cache_query_tokens"] += r.tl.num_tokens
                c["cache_hit_tokens"] += r.cached_tokens
            if p.restored_tokens:
                c["restores"] += 1
                c["restored_tokens"] += p.restored_tokens
            try:
                budget -= self._take_slice(r, budget, slices)
            except Exception as e:
                slices[:] = [(q, sl) for q, sl in slices if q is not r]
                events.append(self._failed(r, e, "prefill", kv_unwritten=True))

    def _keep_used_after(self, r: RequestState) -> float | None:
        """Admission's protection for ``r``'s plan (see the module docstring): None when
        nobody else runs (waiting would free nothing) or ``r`` has waited its bound."""
        now = time.monotonic()
        if not (self.running or self.prefilling):
            return None
        if now - r.waiting_since >= self.admission_max_wait_s:
            return None
        return now - self.admission_window_s

    def _decode_rows(self, prefilling: bool, events: list[TokenEvent]) -> Work:
        """One row per decoding request that has a page for its next token, oldest first;
        when one finds none, the youngest still without a row is preempted until it does."""
        work: Work = []
        stalled: list[RequestState] = []
        queue = deque(sorted((r for r in self.running.values() if r.status == "decode"),
                             key=lambda q: q.arrival))
        while queue:
            r = queue.popleft()
            try:
                dp = self.planner.decode_pass(r)
                while dp is None and queue:
                    self._preempt(queue.pop())
                    dp = self.planner.decode_pass(r)
            except Exception as e:
                events.append(self._failed(r, e, "decode"))
                continue
            if dp is None:  # nobody younger to preempt: it waits for older ones to finish
                stalled.append(r)
                continue
            work.append((r, dp))
        if stalled and not work and not prefilling:
            # Nobody else can free pages: fail the youngest stalled request (its pages go back
            # to the pool) so that the others can go on; never end one silently short.
            r = max(stalled, key=lambda q: q.arrival)
            events.append(self._fail(r, (
                f"the KV pool ({self.num_pages} pages) is full: {len(stalled)} decoding "
                "requests hold every page; raise --max-total-tokens"
            )))
        return work

    def _run(self, slices: Work, decode_pass: Work) -> list[TokenEvent]:
        """Run this step's forwards and sample from their logits.

        Prefill slices and decode rows run as two forwards, as SGLang runs prefill and
        decode batches: a prefill wants wide query blocks, a decode row one query, and one
        block size for both would pad every decode row to a prefill block. Disaggregated,
        they run on their own groups (a finished prefill's pages are handed over first),
        and both are dispatched before either result is read, so they overlap."""
        ex = self.executor
        events: list[TokenEvent] = []
        parts: list[tuple[str, Work, jax.Array]] = []
        if slices:
            try:
                out = ex.run_prefill(slices)
                done = [r for r, sl in slices if sl.logits_row >= 0]
                ex.to_decode([pg for r in done for pg in r.prefill.written_pages])
                parts.append(("prefill", slices, out))
            except Exception as e:
                events.extend(self._forward_failed(slices, e, "prefill"))
        if decode_pass:
            try:
                parts.append(("decode", decode_pass, ex.run_decode(decode_pass)))
            except Exception as e:
                events.extend(self._forward_failed(decode_pass, e, "decode"))
        # Grammar masks of constrained rows, computed while the forwards run (dispatch is
        # asynchronous; a grammar's state depends only on tokens already sampled); greedy
        # ones are applied on the device, after the forward.
        masks: dict[str, np.ndarray] = {}
        masked: list[MaskedGreedy] = []
        for _, work, out in parts:
            m = MaskedGreedy()
            for i, r in enumerate(r for r, p in work if p.logits_row >= 0):
                c = r.req.constraint
                if c is not None and not r.resumed:
                    masks[r.rid] = c.allowed()
                    if r.req.sampling.temperature == 0:
                        m.add(r.rid, i, c.bitmask())
            m.dispatch(out.logits)
            masked.append(m)
        results = []
        for (what, work, out), m in zip(parts, masked, strict=True):
            try:
                # The greedy summary only (a few numbers a row); a failed dispatch surfaces
                # here. Full logits rows come to the host for the rows that sample.
                greedy = (np.asarray(out.greedy), np.asarray(out.greedy_logprob),
                          np.asarray(out.ok))
                results.append((work, out, greedy, m))
            except Exception as e:
                events.extend(self._forward_failed(work, e, what))
        for work, out, (toks, lps, oks), m in results:
            with_logits = [r for r, p in work if p.logits_row >= 0]
            for i, r in enumerate(with_logits):
                try:
                    if r.status == "prefill":
                        self._prefill_done(r)
                        if r.resumed:  # its next token was sampled before it was preempted
                            r.resumed = False
                            continue
                    sp = r.req.sampling
                    greedy_ok = sp.temperature == 0 and oks[i] and invalid_param(sp) is None
                    if r.req.constraint is not None:
                        events.extend(self._sample_constrained(
                            r, masks[r.rid], int(toks[i]) if greedy_ok else -1, float(lps[i]),
                            m.result(r.rid) if greedy_ok else None,
                            lambda i=i, out=out: np.asarray(out.logits[i]),
                        ))
                    elif greedy_ok:
                        events.extend(self._emit(r, int(toks[i]), float(lps[i])))
                    else:
                        events.extend(self._sample(r, np.asarray(out.logits[i])))
                except Exception as e:
                    events.append(self._failed(r, e, "sampling"))
        return events

    def _forward_failed(self, work: Work, e: Exception, what: str) -> list[TokenEvent]:
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

    def _digest(self, slices: Work, decode_pass: Work) -> bytes:
        """What this step runs and the state it runs on, hashed (the same on every process
        of a multi-host run unless their engines have diverged)."""
        state = (
            [(r.rid, len(p.tokens), p.logits_row) for r, p in slices],
            [r.rid for r, _ in decode_pass],
            self.cache.used_pages,
            [r.rid for r in self.waiting],
            sorted(self.running),
            sorted(self.prefilling),
        )
        return digest(state)

    def _take_slice(self, r: RequestState, budget: int, slices: Work) -> int:
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
            self.cache.mark_written(self._written_by(r), self._step_id)
        return b - a

    def _still_read(self, r: RequestState) -> list:
        """Nodes of ``r``'s path with a page that a row of its pass not yet run sees or
        writes (a segment also lists the pages of dropped KV, every slot invisible: they
        stand in for what it does not read, as the page-0 stand-ins of emptied nodes do)."""
        p, done, ps = r.prefill, r.prefill_done, self.page_size
        pages: set[int] = set()
        for s in p.segments:
            if s.q_start + s.q_len > done:
                vis = np.zeros(len(s.pages) * ps, bool)
                vis[: len(s.kv_visible)] = s.kv_visible
                seen = vis.reshape(-1, ps).any(1)
                pages.update(pg for pg, v in zip(s.pages, seen, strict=True) if v)
        return [n for n in self.cache.path_to(r.last_node)
                if n.pages and not pages.isdisjoint(n.pages)]

    def _written_by(self, r: RequestState):
        return self.cache.written_by(self.cache.path_to(r.last_node), r.rid)

    def _prefill_done(self, r: RequestState) -> None:
        del self.prefilling[r.rid]
        r.prefill = None
        r.status = "decode"
        self.running[r.rid] = r

    def _preempt(self, r: RequestState) -> None:
        """Swap decoding request ``r`` out (see the module docstring): its fed tokens' KV
        enters the cache as the last segment of its continuation request, which waits at
        the head of the queue; its sampler state and generated tokens stay with it."""
        del self.running[r.rid]
        fed = r.generated[r.gen_base : len(r.generated) - r.unfed]
        self._release(r, insert=True)
        if fed:
            req, h = r.req, r.req.history
            segments = [*req.segments, list(fed)]
            history = OpHistory(len(segments), h.drops, h.repos)
            r.req = dataclasses.replace(req, segments=segments, history=history, prepared=None)
            r.tl = timeline([len(x) for x in segments], history)
            r.keys = RequestKeys.of(segments, history)
        r.gen_base = len(r.generated) - r.unfed
        r.resumed = True
        r.status = "waiting"
        r.waiting_since = time.monotonic()
        r.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(r)

    # ------------------------------------------------------------------ sampling
    def _sample(self, r: RequestState, logits: np.ndarray) -> list[TokenEvent]:
        """Sample ``r``'s next token (math in sampler.py) and decide whether it finishes."""
        tok, logprob = sample(logits, r.req.sampling, r.rng)
        return self._emit(r, tok, logprob)

    def _sample_constrained(
        self, r: RequestState, allowed: np.ndarray, greedy: int, greedy_lp: float,
        masked: tuple[int, float] | None, row: Callable[[], np.ndarray],
    ) -> list[TokenEvent]:
        """Sample under ``r``'s grammar: the logits row with every id the grammar forbids at
        ``-inf``, so an allowed token has the chance the free request would give it among
        the allowed ones. A greedy token the grammar allows is the masked row's greedy token
        too (same first-index tie rule); otherwise a greedy row's ``masked`` result, from
        the device, is (so neither row leaves the device)."""
        if 0 <= greedy < allowed.size and allowed[greedy]:
            tok, logprob = greedy, greedy_lp
        elif masked is not None and 0 <= masked[0] < allowed.size and allowed[masked[0]]:
            tok, logprob = masked
        else:
            logits = row()
            width = min(allowed.size, logits.size)
            masked = np.full(logits.shape, -np.inf)
            masked[:width] = np.where(allowed[:width], logits[:width], -np.inf)
            tok, _ = sample(masked, r.req.sampling, r.rng)
            logprob = float(log_softmax(logits)[tok])  # the model's own, as for free rows
        r.req.constraint.advance(tok)
        return self._emit(r, tok, logprob)

    def _emit(self, r: RequestState, tok: int, logprob: float) -> list[TokenEvent]:
        """``r`` generated ``tok`` (sampled on the host, or greedy from the step's summary,
        which is the same token: the first index of the largest logit), which its pass's
        forward makes the only unfed token. Then the tokens its grammar forces, if any, are
        appended without a decode step each (jump-forward): the next decode pass feeds them
        all at once. A forced token has no log-probability (no logits were computed for it)."""
        r.unfed = 0
        events = self._append(r, tok, logprob)
        c = r.req.constraint
        while c is not None and self.jump_forward and not events[-1].finished:
            forced = c.forced()
            if not forced:
                break
            for f in forced:
                c.advance(f)
                events.extend(self._append(r, f, float("nan")))
                if events[-1].finished:
                    break
        return events

    def _append(self, r: RequestState, tok: int, logprob: float) -> list[TokenEvent]:
        sp = r.req.sampling
        r.generated.append(tok)
        r.unfed += 1
        lp = logprob if r.req.return_logprob else None
        reason = None
        if not sp.ignore_eos and tok in self.eos_ids:
            reason = "stop"
        elif tok in sp.stop_token_ids:
            reason = "stop"
        elif r.req.constraint is not None and r.req.constraint.finished:
            reason = "stop"  # the grammar is complete: nothing more may follow
        elif len(r.generated) >= sp.max_new_tokens:
            reason = "length"
        if reason is None:
            meta = self._meta(r) if len(r.generated) == 1 else {}
            return [TokenEvent(r.rid, tok, lp, False, None, meta)]
        ev = self._finish(r, reason)
        ev.token_id, ev.logprob = tok, lp
        return [ev]

    @staticmethod
    def _meta(r: RequestState) -> dict:
        return dict(
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            active_tokens=int(r.tl.final_active.sum()) + len(r.generated) - r.gen_base,
        )

    def _finish(self, r: RequestState, reason: str) -> TokenEvent:
        self.running.pop(r.rid, None)
        meta = dict(self._meta(r), completion_tokens=len(r.generated), finish_reason=reason)
        self._release(r, insert=True)
        self.counters["requests_finished"] += 1
        return TokenEvent(r.rid, -1, None, True, reason, meta)

    def _release(self, r: RequestState, insert: bool) -> None:
        """Hand generated KV to the cache (the next turn reuses it) and unlock the path."""
        fed = r.generated[r.gen_base : len(r.generated) - r.unfed]  # the rest has no KV
        pages = r.gen_pages
        r.gen_pages = []
        if insert and fed and r.prompt_last_node is not None:
            keep = self.cache.pages_for(len(fed))
            self.executor.to_prefill(pages[:keep])
            self.cache.insert(r.prompt_last_node, tuple(fed), r.tl.num_tokens, pages[:keep])
            pages = pages[keep:]
        if pages:
            self.cache.free(pages)
        self.cache.release(r.last_node, r.view_nodes)
        r.view_nodes = []
        r.last_node = None
        r.status = "done"
