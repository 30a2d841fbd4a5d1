"""The serving engine: the scheduler that admits requests, plans them, runs one prefill and
one decode forward per step over every request's work, and samples.

Request life cycle:

1. ``add_request`` validates and queues. The request's history is flattened into radix keys
   (tokens and op items, ``radix_keys.request_keys``) and its :class:`Timeline` says, for every
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
``token_rules.py`` says what a sampled token does to its request; ``admission.py`` checks a
request before it queues. This module holds the queues and the request life cycle: every
way a request ends, normally or by a fault in any stage, is stated here beside the stage.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable

import jax
import numpy as np

from akv_jax.cache.timeline import Timeline
from akv_jax.serving.admission import check_request
from akv_jax.serving.cache_manager import CacheManager
from akv_jax.serving.constrained_rows import MaskedGreedy
from akv_jax.serving.device_group import StepLogits
from akv_jax.serving.executor import Executor
from akv_jax.serving.multihost import end_run_on_forward_error, step_digest
from akv_jax.serving.overlap import Deferred, defer, link
from akv_jax.serving.planner import Planner, PoolTooSmall
from akv_jax.serving.radix_keys import RequestKeys
from akv_jax.serving.sampler import invalid_param, make_rng, sample
from akv_jax.serving.scheduling import Scheduler
from akv_jax.serving.token_rules import TokenRules, request_meta
from akv_jax.serving.types import GenerateRequest, TokenEvent, describe_error
from akv_jax.serving.work import RequestState, Work

log = logging.getLogger("akv_jax.serving")

__all__ = ["Engine", "PoolTooSmall"]


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
        overlap: bool = True,
        deterministic: bool = False,
    ):
        """``tp``: tensor-parallel degree of the (colocated) device group.
        ``disaggregate=(P, D)``: prefill and restores on the first P devices, decode on the
        next D (each group tensor-parallel over its devices), KV pages handed between them.
        ``host_kv_tokens``: the host tier's size (None: four times the device pool; 0: no
        host tier; always none across several processes, whose host memories differ).
        ``admission_window_s`` / ``admission_max_wait_s``: see the module docstring.
        ``jump_forward``: feed the tokens a request's grammar forces in one decode pass
        instead of a step each (the same tokens either way: a forced token is the only one
        its grammar allows).
        ``overlap``: read greedy decode tokens a step late, planning and dispatching the next
        step while the device runs this one (overlap.py; one process only: the processes of
        a multi-host run read every step in step). ``deterministic``: see the Executor."""
        self.cfg = model.cfg
        tok = getattr(model, "tokenizer", None)
        eos_ids = set(model.cfg.eos_token_ids) | set(getattr(tok, "eos_ids", ()) or ())
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
            deterministic=deterministic,
        )
        self.cache = CacheManager(self.num_pages, page_size, self.num_host_pages,
                                  self.executor if self.num_host_pages else None)
        self.admission_window_s = admission_window_s
        self.admission_max_wait_s = admission_max_wait_s
        self.planner = Planner(self.cache, canonical_layout=self.executor.layout_sets_bits)
        self.backend = attention_backend
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.tokens = TokenRules(eos_ids, jump_forward, self.finish)
        self.overlap = overlap and jax.process_count() == 1
        self.deferred: Deferred | None = None  # the last decode step, its tokens unread
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
        self.step_id = 0
        self.scheduler = Scheduler(self)

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
        self._unqueue(r)
        if self.running.get(r.rid) is r:
            del self.running[r.rid]
        if self.prefilling.get(r.rid) is r:
            del self.prefilling[r.rid]
            # Part of its KV is unwritten: back to evicted before anyone may match it.
            self.cache.unwrite(self.scheduler.written_by(r))
        if r.gen_pages or r.last_node is not None:
            self.release(r, insert=False)
        r.status = "done"

    def _unqueue(self, r: RequestState) -> None:
        for i, q in enumerate(self.waiting):
            if q is r:  # by identity: requests compare by value
                del self.waiting[i]
                return

    def fail(self, rid: str, message: str) -> TokenEvent | None:
        """End request ``rid`` with an error event (None if it is not queued or running).

        Multi-host followers apply this when the leader reports a request it failed."""
        r = self.running.get(rid) or self.prefilling.get(rid)
        r = r or next((q for q in self.waiting if q.rid == rid), None)
        return None if r is None else self.fail_request(r, message)

    def fail_request(self, r: RequestState, message: str, kv_unwritten: bool = False) -> TokenEvent:
        """End ``r`` with an error event, releasing what it holds as an abort does.

        ``kv_unwritten``: the forward that was to write its prefill did not run, so every
        node its pass computes (written_pages) goes back to evicted, last slice included
        (``Scheduler.take_slice`` has already published those nodes as written)."""
        meta = dict(request_meta(r), completion_tokens=r.completion_tokens,
                    finish_reason="error")
        if kv_unwritten and r.prefill is not None and r.last_node is not None:
            mine = set(r.prefill.written_pages)
            self.cache.unwrite([n for n in self.cache.path_to(r.last_node)
                                if n.pages and mine.intersection(n.pages)])
        self._drop(r)
        self.counters["requests_failed"] += 1
        return TokenEvent(r.rid, -1, None, True, "error", meta, error=message)

    def fail_on_error(self, r: RequestState, e: Exception, where: str, kv_unwritten: bool = False):
        """``_fail`` for an exception raised by ``r``'s own work; the traceback goes to the
        log, a one-line message to the client."""
        log.error("request %s failed in %s", r.rid, where, exc_info=e)
        return self.fail_request(r, f"engine error ({where}): {describe_error(e)}", kv_unwritten)

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
        self.deferred = None
        self.cache.reset()
        self.counters["requests_failed"] += len(reqs)
        return events

    # ------------------------------------------------------------------ state
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling or self.deferred)

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
        self.step_id += 1
        self.cache.new_step()
        events: list[TokenEvent] = []
        slices, budget = self.scheduler.continue_prefills(events)
        self.scheduler.admit(slices, budget, events)
        decode_pass = self.scheduler.decode_rows(bool(slices), events)
        previous, self.deferred = self.deferred, None
        link(decode_pass, previous)
        if self.replica_check is not None:
            # Multi-host: every process must run the same forwards on the same state.
            self.replica_check(self.step_id, step_digest(self, slices, decode_pass))
        if slices or decode_pass:
            events.extend(self._run(slices, decode_pass, previous))
        elif previous is not None:
            events.extend(self._read_deferred(previous))
        return events

    def _run(self, slices: Work, decode_pass: Work, previous: Deferred | None) -> list[TokenEvent]:
        """Run this step's forwards and sample from their logits.

        Prefill slices and decode rows run as two forwards, as SGLang runs prefill and
        decode batches: a prefill wants wide query blocks, a decode row one query, and one
        block size for both would pad every decode row to a prefill block. Disaggregated,
        they run on their own groups (a finished prefill's pages are handed over first),
        and both are dispatched before either result is read, so they overlap. Then the
        tokens ``previous`` deferred are read, and with overlap this step's greedy decode
        rows are deferred in turn (overlap.py)."""
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
            decode_pass, out, previous = self._dispatch_decode(decode_pass, previous, events)
            if out is not None:
                self.deferred = defer(decode_pass, out) if self.overlap else None
                if self.deferred is None or len(self.deferred.rows) < len(decode_pass):
                    parts.append(("decode", decode_pass, out))  # rows read in this step
        if previous is not None:
            events.extend(self._read_deferred(previous))
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
                if r.status == "done" or r.token_pending:
                    continue  # ended meanwhile (a token read late), or deferred
                try:
                    if r.status == "prefill":
                        self.scheduler.prefill_done(r)
                        if r.resumed:  # its next token was sampled before it was preempted
                            r.resumed = False
                            continue
                    sp = r.req.sampling
                    greedy_ok = sp.temperature == 0 and oks[i] and invalid_param(sp) is None
                    if r.req.constraint is not None:
                        events.extend(self.tokens.sample_constrained(
                            r, masks[r.rid], int(toks[i]) if greedy_ok else -1, float(lps[i]),
                            m.result(r.rid) if greedy_ok else None,
                            lambda i=i, out=out: np.asarray(out.logits[i]),
                        ))
                    elif greedy_ok:
                        events.extend(self.tokens.emit(r, int(toks[i]), float(lps[i])))
                    else:
                        events.extend(self.tokens.sample(r, np.asarray(out.logits[i])))
                except Exception as e:
                    events.append(self.fail_on_error(r, e, "sampling"))
        return events

    def _dispatch_decode(self, work: Work, previous: Deferred | None, events: list[TokenEvent]
                         ) -> tuple[Work, StepLogits | None, Deferred | None]:
        """Dispatch the decode forward; returns the rows it carries, its output (None if it
        failed) and ``previous`` unless it was read here. When a forward that feeds on
        ``previous`` cannot be dispatched, ``previous`` may be what failed: it is read
        first (failing its requests if so), and the others run with their tokens known."""
        try:
            return work, self.executor.run_decode(work, previous and previous.out), previous
        except Exception as e:
            error = e
        read = self._read_deferred(previous) if previous is not None else []
        events.extend(read)
        work = [(r, p) for r, p in work if r.status != "done"]
        if not any(ev.error for ev in read):  # the forward's own fault
            events.extend(self._forward_failed(work, error, "decode"))
            return [], None, None
        for r, p in work:
            if p.pending_from >= 0:
                p.tokens[-1], p.pending_from = r.generated[-1], -1
        if not work:
            return [], None, None
        try:
            return work, self.executor.run_decode(work), None
        except Exception as e:
            events.extend(self._forward_failed(work, e, "decode"))
            return [], None, None

    def _read_deferred(self, d: Deferred) -> list[TokenEvent]:
        """The tokens of a decode step run one step ago (see overlap.py): each request still
        waiting for its token gets it, and ends if that token ends it."""
        rows = d.live_rows()
        try:
            toks, lps, oks = (np.asarray(a) for a in (d.out.greedy, d.out.greedy_logprob,
                                                      d.out.ok))
        except Exception as e:
            return self._forward_failed([(r, None) for r, _, _ in rows], e, "decode")
        events: list[TokenEvent] = []
        for r, index, row in rows:
            try:
                if oks[row]:
                    tok, lp = int(toks[row]), float(lps[row])
                else:  # not a usable row: the host sampler says why
                    tok, lp = sample(np.asarray(d.out.logits[row]), r.req.sampling, r.rng)
                events.extend(self.tokens.resolve(r, index, tok, lp))
            except Exception as e:
                events.append(self.fail_on_error(r, e, "sampling"))
        return events

    def _forward_failed(self, work: Work, e: Exception, what: str) -> list[TokenEvent]:
        """Fail the requests whose rows a forward that raised carried."""
        end_run_on_forward_error(e, what)
        log.error("the %s forward failed; failing its %d requests", what, len(work), exc_info=e)
        msg = f"engine error ({what} forward): {describe_error(e)}"
        return [self.fail_request(r, msg, kv_unwritten=True) for r, _ in work]

    # ------------------------------------------------------------------ sampling
    def finish(self, r: RequestState, reason: str) -> TokenEvent:
        """End ``r`` normally: its generated KV joins the cache; its last event. (A request
        preempted while its last token was deferred may end from the waiting queue.)"""
        self.running.pop(r.rid, None)
        if r.status == "waiting":
            self._unqueue(r)
        meta = dict(request_meta(r), completion_tokens=len(r.generated), finish_reason=reason)
        self.release(r, insert=True)
        self.counters["requests_finished"] += 1
        return TokenEvent(r.rid, -1, None, True, reason, meta)

    def release(self, r: RequestState, insert: bool) -> None:
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
