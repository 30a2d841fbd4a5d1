"""What a sampled token does to its request: sampling (free or under a grammar), the tokens
a grammar then forces (jump-forward), and whether the request finishes (stop ids, the
grammar's end, the length limit). The math of sampling is in sampler.py."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from akv_jax.serving.sampler import log_softmax, sample
from akv_jax.serving.types import TokenEvent
from akv_jax.serving.work import RequestState


class TokenRules:
    """``eos_ids``: the model's end ids; ``jump_forward``: feed the tokens a request's grammar
    forces in one decode pass instead of a step each; ``finish(r, reason)``: the engine ends
    ``r`` (releases what it holds) and returns its last event."""

    def __init__(self, eos_ids: set[int], jump_forward: bool,
                 finish: Callable[[RequestState, str], TokenEvent]):
        self.eos_ids = eos_ids
        self.jump_forward = jump_forward
        self.finish = finish

    def sample(self, r: RequestState, logits: np.ndarray) -> list[TokenEvent]:
        """Sample ``r``'s next token (math in sampler.py) and decide whether it finishes."""
        tok, logprob = sample(logits, r.req.sampling, r.rng)
        return self.emit(r, tok, logprob)

    def sample_constrained(
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
        return self.emit(r, tok, logprob)

    def emit(self, r: RequestState, tok: int, logprob: float) -> list[TokenEvent]:
        """``r`` generated ``tok`` (sampled on the host, or greedy from the step's summary,
        which is the same token: the first index of the largest logit), which its pass's
        forward makes the only unfed token. Then the tokens its grammar forces, if any, are
        appended without a decode step each (jump-forward): the next decode pass feeds them
        all at once. A forced token has no log-probability (no logits were computed for it)."""
        r.unfed = 0
        events = self.append(r, tok, logprob)
        c = r.req.constraint
        while c is not None and self.jump_forward and not events[-1].finished:
            forced = c.forced()
            if not forced:
                break
            for f in forced:
                c.advance(f)
                events.extend(self.append(r, f, float("nan")))
                if events[-1].finished:
                    break
        return events

    def append(self, r: RequestState, tok: int, logprob: float) -> list[TokenEvent]:
        r.generated.append(tok)
        r.unfed += 1
        n = len(r.generated)
        return self.sent(r, n - 1, tok, logprob, self.stop_reason(r, tok, n))

    def resolve(self, r: RequestState, index: int, tok: int, logprob: float) -> list[TokenEvent]:
        """``r``'s PENDING token at ``index`` of its generated tokens is ``tok`` (read a step
        late, see overlap.py). If it ends ``r``, what was fed after it is discarded: ``tok``
        becomes the last token, unfed, as if ``r`` had ended in its own step."""
        r.generated[index] = tok
        reason = self.stop_reason(r, tok, index + 1)
        if reason is not None:
            del r.generated[index + 1 :]
            r.unfed = 1
        return self.sent(r, index, tok, logprob, reason)

    def sent(self, r: RequestState, index: int, tok: int, logprob: float,
             reason: str | None) -> list[TokenEvent]:
        """The event of ``r``'s generated token ``index`` (``tok``), which ends ``r`` for
        ``reason`` (None: it goes on)."""
        lp = logprob if r.req.return_logprob else None
        if reason is None:
            meta = request_meta(r) if index == 0 else {}
            return [TokenEvent(r.rid, tok, lp, False, None, meta)]
        ev = self.finish(r, reason)
        ev.token_id, ev.logprob = tok, lp
        return [ev]

    def stop_reason(self, r: RequestState, tok: int, count: int) -> str | None:
        """Why ``r`` ends with ``tok`` as its ``count``-th generated token (None: it goes on)."""
        sp = r.req.sampling
        if not sp.ignore_eos and tok in self.eos_ids:
            return "stop"
        if tok in sp.stop_token_ids:
            return "stop"
        if r.req.constraint is not None and r.req.constraint.finished:
            return "stop"  # the grammar is complete: nothing more may follow
        if count >= sp.max_new_tokens:
            return "length"
        return None


def request_meta(r: RequestState) -> dict:
    """What a request's first and last events report about it."""
    return dict(
        prompt_tokens=r.prompt_tokens,
        cached_tokens=r.cached_tokens,
        active_tokens=int(r.tl.final_active.sum()) + len(r.generated) - r.gen_base,
    )
