"""Which work a step runs: the next slices of prefills under way, new admissions within the
step's row budget, one decode row per running request (preempting the youngest when pages
run out), and the moves between the engine's queues that follow (DESIGN.md §4).

The queues and the ways a request ends live in the engine (engine.py); this module reads
and moves requests between them.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from akv_jax.cache.ops import OpHistory
from akv_jax.cache.timeline import timeline
from akv_jax.serving.planner import PoolTooSmall
from akv_jax.serving.radix_keys import RequestKeys
from akv_jax.serving.types import TokenEvent
from akv_jax.serving.work import RequestState, Work

if TYPE_CHECKING:
    from akv_jax.serving.engine import Engine


class Scheduler:
    """The step's choice of work for ``engine`` (its queues, planner and cache)."""

    def __init__(self, engine: Engine):
        self.e = engine

    def continue_prefills(self, events: list[TokenEvent]) -> tuple[Work, int]:
        """The next slices of passes already under way, oldest first, within
        ``prefill_chunk`` rows; returns them and the rows left for new admissions."""
        slices: Work = []
        budget = self.e.prefill_chunk
        for r in list(self.e.prefilling.values()):
            try:
                # What its remaining rows read stays pinned until they have run: dead KV
                # they still read must not be evicted by this step's allocations; dead KV
                # only earlier slices read may go.
                self.e.cache.pin(self.still_read(r))
                if budget > 0:
                    budget -= self.take_slice(r, budget, slices)
            except Exception as e:
                slices[:] = [(q, sl) for q, sl in slices if q is not r]
                events.append(self.e.fail_on_error(r, e, "prefill", kv_unwritten=True))
        return slices, budget

    def admit(self, slices: Work, budget: int, events: list[TokenEvent]) -> None:
        """Plan waiting requests in arrival order while rows and running slots last; each
        admitted request's first slice joins ``slices``."""
        while (
            self.e.waiting
            and budget > 0
            and len(self.e.running) + len(self.e.prefilling) < self.e.max_running
        ):
            r = self.e.waiting[0]
            cached = r.cached_tokens
            try:
                # Undone in the cache if it raises.
                p = self.e.planner.plan(r, self.e.step_id, self.keep_used_after(r))
            except Exception as e:
                if isinstance(e, PoolTooSmall):  # a clear answer, not a fault: nothing to log
                    events.append(self.e.fail_request(r, str(e)))
                else:
                    events.append(self.e.fail_on_error(r, e, "planning"))
                continue
            c = self.e.counters
            if p is None:
                c["admission_waits"] += 1
                break
            self.e.waiting.popleft()
            r.prefill, r.prefill_done, r.status = p, 0, "prefill"
            self.e.prefilling[r.rid] = r
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
                budget -= self.take_slice(r, budget, slices)
            except Exception as e:
                slices[:] = [(q, sl) for q, sl in slices if q is not r]
                events.append(self.e.fail_on_error(r, e, "prefill", kv_unwritten=True))

    def keep_used_after(self, r: RequestState) -> float | None:
        """Admission's protection for ``r``'s plan (see the module docstring): None when
        nobody else runs (waiting would free nothing) or ``r`` has waited its bound."""
        now = time.monotonic()
        if not (self.e.running or self.e.prefilling):
            return None
        if now - r.waiting_since >= self.e.admission_max_wait_s:
            return None
        return now - self.e.admission_window_s

    def decode_rows(self, prefilling: bool, events: list[TokenEvent]) -> Work:
        """One row per decoding request that has a page for its next token, oldest first;
        when one finds none, the youngest still without a row is preempted until it does."""
        work: Work = []
        stalled: list[RequestState] = []
        queue = deque(sorted((r for r in self.e.running.values()
                              if r.status == "decode" and not self.ends_when_read(r)),
                             key=lambda q: q.arrival))
        while queue:
            r = queue.popleft()
            try:
                dp = self.e.planner.decode_pass(r)
                while dp is None and queue:
                    self.preempt(queue.pop())
                    dp = self.e.planner.decode_pass(r)
            except Exception as e:
                events.append(self.e.fail_on_error(r, e, "decode"))
                continue
            if dp is None:  # nobody younger to preempt: it waits for older ones to finish
                stalled.append(r)
                continue
            work.append((r, dp))
        if stalled and not work and not prefilling and self.e.deferred is None:
            # Nobody else can free pages (tokens still to be read may end requests, which
            # frees theirs: overlap.py): fail the youngest stalled request (its pages go back
            # to the pool) so that the others can go on; never end one silently short.
            r = max(stalled, key=lambda q: q.arrival)
            events.append(self.e.fail_request(r, (
                f"the KV pool ({self.e.num_pages} pages) is full: {len(stalled)} decoding "
                "requests hold every page; raise --max-total-tokens"
            )))
        return work

    @staticmethod
    def ends_when_read(r: RequestState) -> bool:
        """``r``'s deferred token (overlap.py) is its last by length: no row for it."""
        return r.token_pending and len(r.generated) >= r.req.sampling.max_new_tokens

    def take_slice(self, r: RequestState, budget: int, slices: Work) -> int:
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
            self.e.cache.mark_written(self.written_by(r), self.e.step_id)
        return b - a

    def still_read(self, r: RequestState) -> list:
        """Nodes of ``r``'s path with a page that a row of its pass not yet run sees or
        writes (a segment also lists the pages of dropped KV, every slot invisible: they
        stand in for what it does not read, as the page-0 stand-ins of emptied nodes do)."""
        p, done, ps = r.prefill, r.prefill_done, self.e.page_size
        pages: set[int] = set()
        for s in p.segments:
            if s.q_start + s.q_len > done:
                vis = np.zeros(len(s.pages) * ps, bool)
                vis[: len(s.kv_visible)] = s.kv_visible
                seen = vis.reshape(-1, ps).any(1)
                pages.update(pg for pg, v in zip(s.pages, seen, strict=True) if v)
        return [n for n in self.e.cache.path_to(r.last_node)
                if n.pages and not pages.isdisjoint(n.pages)]

    def written_by(self, r: RequestState):
        return self.e.cache.written_by(self.e.cache.path_to(r.last_node), r.rid)

    def prefill_done(self, r: RequestState) -> None:
        del self.e.prefilling[r.rid]
        r.prefill = None
        r.status = "decode"
        self.e.running[r.rid] = r

    def preempt(self, r: RequestState) -> None:
        """Swap decoding request ``r`` out (see the module docstring): its fed tokens' KV
        enters the cache as the last segment of its continuation request, which waits at
        the head of the queue; its sampler state and generated tokens stay with it."""
        del self.e.running[r.rid]
        fed = r.generated[r.gen_base : len(r.generated) - r.unfed]
        self.e.release(r, insert=True)
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
        self.e.counters["preemptions"] += 1
        self.e.waiting.appendleft(r)
