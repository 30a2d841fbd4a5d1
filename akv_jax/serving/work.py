"""What the scheduler tracks for one request, and what one forward runs for it.

A :class:`RequestState` is created at admission and lives until the request finishes; the
planner fills in its view, the scheduler its status and generated tokens. A :class:`Pass`
is one request's share of a forward: rows (token, position, where its K/V goes), the
attention segments those rows form, and pre-pass copies that re-encode resident keys.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from akv_jax.cache.timeline import Timeline
from akv_jax.pallas.metadata import SegmentSpec
from akv_jax.serving.radix import Node
from akv_jax.serving.radix_keys import RequestKeys
from akv_jax.serving.types import GenerateRequest

# In a request's generated tokens: a greedy token its last decode row computed on the device
# and the host has not read yet (overlap scheduling, see overlap.py); only ever the last.
PENDING = -1

# A write's slot that writes nothing: a version its token's chain of re-rotations passes
# through (see akv_jax.model.forward.KVWrites).
NO_WRITE = -1


@dataclasses.dataclass
class Pass:
    """One request's share of a step: query segments, writes and pre-pass copies."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    q_pos: list[int] = dataclasses.field(default_factory=list)
    writes: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    segments: list[SegmentSpec] = dataclasses.field(default_factory=list)
    # (src slot, dst slot, old pos, new pos, stage): a stage's copies run after the previous
    # stage's, whose destinations they may read (a version re-rotated from the one before).
    copies: list[tuple[int, int, int, int, int]] = dataclasses.field(default_factory=list)
    logits_row: int = -1  # -1: no logits wanted (a slice before the last)
    written_pages: list[int] = dataclasses.field(default_factory=list)
    restored_tokens: int = 0  # tokens of emptied nodes this pass recomputes (a restore)
    # Its last token is PENDING: the executor feeds it from this row of the previous decode
    # step's greedy output, still on the device (-1: every token is known).
    pending_from: int = -1

    def slice(self, a: int, b: int) -> Pass:
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
        return Pass(
            tokens=self.tokens[a:b],
            q_pos=self.q_pos[a:b],
            writes=self.writes[a:b],
            segments=segs,
            copies=self.copies if a == 0 else [],
            logits_row=self.logits_row - a if a <= self.logits_row < b else -1,
        )


@dataclasses.dataclass
class RequestState:
    req: GenerateRequest
    tl: Timeline
    keys: RequestKeys
    arrival: float
    status: str = "waiting"  # waiting | prefill | decode | done
    last_node: Node | None = None
    prompt_last_node: Node | None = None
    # The final version's view as decode reads it, snapshotted once per prefill: the pages
    # holding a token it still attends to (int32) and their slots' visibility (bool). Nodes
    # may be split later by other requests' matches, but their pages never move.
    view_pages: np.ndarray | None = None
    view_visible: np.ndarray | None = None
    view_nodes: list[Node] = dataclasses.field(default_factory=list)  # final view, any visible
    gen_pages: list[int] = dataclasses.field(default_factory=list)
    generated: list[int] = dataclasses.field(default_factory=list)
    # Generated tokens at the end with no KV yet: the one sampled last, plus any a grammar
    # forced after it (jump-forward), all fed by its next decode pass.
    unfed: int = 1
    cached_tokens: int = 0
    rng: np.random.Generator | None = None
    prefill: Pass | None = None  # the planned pass while it runs, slice by slice
    prefill_done: int = 0  # rows of it already run
    # Preemption (engine.py): a preempted request resumes as its prompt followed by the
    # tokens it had fed (one more segment); ``gen_base`` of its generated tokens are then
    # part of that prompt, and ``resumed`` says its next prefill only rebuilds state.
    gen_base: int = 0
    resumed: bool = False
    prompt_tokens: int = 0  # the original prompt's length (the usage reported)
    waiting_since: float = 0.0  # when it last entered the waiting queue
    preemptions: int = 0

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def token_pending(self) -> bool:
        """Its last generated token is PENDING (on the device, not read yet)."""
        return bool(self.generated) and self.generated[-1] == PENDING

    @property
    def completion_tokens(self) -> int:
        """Generated tokens its client has been sent (a PENDING one not yet)."""
        return len(self.generated) - self.token_pending

    @property
    def new_tokens_left(self) -> int:
        """Tokens it may still generate, the one sampled last and not yet fed included."""
        return self.req.sampling.max_new_tokens - self.gen_base


# A step's work of one kind (prefill slices or decode rows): each request with its pass.
Work = list[tuple[RequestState, Pass]]
