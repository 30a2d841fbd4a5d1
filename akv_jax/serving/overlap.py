"""Overlap scheduling: a greedy decode row's token is read on the host one step late, so the
host plans and dispatches step n+1 while the device still runs step n (as SGLang's overlap
scheduler does).

After step n is dispatched, each such request's generated tokens end with PENDING; step n+1
feeds that token straight from step n's device output (``Pass.pending_from``), and step n's
result is read once step n+1 is on its way. A request that the pending token ends (an end
id, a stop id) is ended then, a step late: the row step n+1 ran for it is wasted, and what it
wrote is never part of the cache (a finished request's last token has no KV in either mode),
so the answers and the cache are the same with or without overlap. Only rows whose token the
step's greedy summary decides are deferred; sampled and constrained rows, whose token the
host picks, are read in their own step.
"""

from __future__ import annotations

import dataclasses

from akv_jax.serving.device_group import StepLogits
from akv_jax.serving.sampler import invalid_param
from akv_jax.serving.work import PENDING, RequestState, Work


@dataclasses.dataclass
class Deferred:
    """A dispatched decode step whose greedy rows are read a step late."""

    out: StepLogits
    # (request, index of its PENDING token in its generated tokens, its logits row in out)
    rows: list[tuple[RequestState, int, int]]

    def live_rows(self) -> list[tuple[RequestState, int, int]]:
        """The rows whose request still waits for that token (not aborted, failed or ended
        meanwhile)."""
        return [(r, i, row) for r, i, row in self.rows
                if r.status != "done" and i < len(r.generated) and r.generated[i] == PENDING]


def deferrable(r: RequestState) -> bool:
    """Whether ``r``'s decode token is the step's greedy token, so it may be read late."""
    sp = r.req.sampling
    return sp.temperature == 0 and r.req.constraint is None and invalid_param(sp) is None


def defer(work: Work, out: StepLogits) -> Deferred | None:
    """Mark the deferrable requests of a dispatched decode ``work`` as waiting for their
    token (PENDING, the only unfed one: the step feeds what was unfed before)."""
    rows = []
    for i, (r, _) in enumerate(work):
        if deferrable(r):
            r.generated.append(PENDING)
            r.unfed = 1
            rows.append((r, len(r.generated) - 1, i))
    return Deferred(out, rows) if rows else None


def link(work: Work, previous: Deferred | None) -> None:
    """Point each pass of ``work`` that feeds a PENDING token at its row of ``previous``."""
    if previous is None:
        return
    row_of = {id(r): row for r, _, row in previous.rows}
    for r, p in work:
        if p.tokens and p.tokens[-1] == PENDING:
            p.pending_from = row_of[id(r)]
