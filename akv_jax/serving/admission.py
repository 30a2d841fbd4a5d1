"""Admission: whether the engine can ever run a request, checked before it queues.

What only the engine knows: its model's vocabulary and position limit, and its KV pool's
size. The request's shape (types, ranges, op-history grammar) was checked by the API
(``protocol.py``) or, for callers of the engine itself, is checked here again by the same
functions. Raises :class:`InvalidField` naming the field.
"""

from __future__ import annotations

from akv_jax.cache.ops import OpHistory, validate_segments
from akv_jax.cache.timeline import Timeline, timeline
from akv_jax.errors import InvalidField
from akv_jax.model.config import ModelConfig
from akv_jax.serving.sampler import invalid_param
from akv_jax.serving.types import GenerateRequest


def check_request(
    req: GenerateRequest, cfg: ModelConfig, page_size: int, num_pages: int
) -> Timeline:
    """``req``'s timeline, or InvalidField for the first problem."""
    validate_segments(req.segments, "input_ids", cfg.vocab_size)
    sp = req.sampling
    if sp.max_new_tokens < 1:
        raise InvalidField("sampling_params.max_new_tokens", "must be at least 1")
    bad = invalid_param(sp)
    if bad is not None:
        raise InvalidField(f"sampling_params.{bad[0]}", bad[1])
    if sp.seed is not None and (isinstance(sp.seed, bool) or not isinstance(sp.seed, int)):
        raise InvalidField("sampling_params.seed", f"{sp.seed!r} is not an integer")
    tl = timeline([len(s) for s in req.segments], req.history)
    limit = cfg.max_position_embeddings
    peak = max(tl.max_position + 1, tl.next_pos + sp.max_new_tokens)
    if peak > limit:
        raise InvalidField(
            "cache.reposition",
            f"context reaches position {peak}, past the model's limit of {limit}: "
            "add a reposition (after dropping messages) to bring positions down",
        )
    need = pages_bound(tl, sp.max_new_tokens, req.history, page_size)
    if need > num_pages:
        raise InvalidField(
            "input_ids",
            f"request needs up to {need} KV pages, the pool has {num_pages}: "
            "raise --max-total-tokens",
        )
    return tl


def pages_bound(tl: Timeline, max_new: int, history: OpHistory, page_size: int) -> int:
    """Pages a request can hold at once, as its own segments lay out: every segment (a node
    each, page-aligned), a compact copy of the tokens active at each repos, and its
    generated tokens."""
    pages = sum(-(-int(n) // page_size) for n in tl.seg_lens) + -(-max_new // page_size)
    for b in history.repos:
        pages += -(-len(tl.active_after(b)) // page_size)
    return pages
