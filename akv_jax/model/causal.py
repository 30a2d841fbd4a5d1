"""Plain causal language-model use of :func:`forward`: logits of a prompt and greedy decoding.

This is the path the golden transformers fixtures check, with no cache operations: one
segment, pages laid out in order, every key visible.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.model.config import ModelConfig
from akv_jax.model.forward import KVPool, KVWrites, forward, make_model_attention
from akv_jax.model.params import Params
from akv_jax.model.rope import rope_table_for
from akv_jax.pallas.metadata import SegmentBatch, SegmentSpec, bucket, build_segment_batch
from akv_jax.pallas.rotary import RopeTable

PAGE_SIZE = 16
BLOCK_Q = 64


@functools.partial(jax.jit, static_argnames=("cfg", "block_q", "backend"))
def _step(params, cfg, tokens, positions, kv, writes, batch, rope, rows, block_q, backend):
    attention = make_model_attention(cfg, backend, block_q)
    return forward(params, cfg, tokens, positions, kv, writes, batch, rope, attention, rows)


def one_segment_batch(start: int, n: int, block_q: int, pages: int) -> SegmentBatch:
    """The batch of one causal segment: ``n`` queries from position ``start`` over the first
    ``pages`` pages, every earlier key visible."""
    spec = SegmentSpec(
        q_start=0,
        q_len=n,
        pages=list(range(pages)),
        kv_visible=np.ones(start + n, bool),
        causal_pos=start,
    )
    return build_segment_batch([spec], page_size=PAGE_SIZE, block_q=block_q, max_pages=pages)


def greedy_generate(
    params: Params,
    cfg: ModelConfig,
    prompt: list[int],
    max_new_tokens: int,
    rope: RopeTable | None = None,
    stop_ids: tuple[int, ...] = (),
    attention_backend: str = "reference",
) -> tuple[np.ndarray, list[int]]:
    """Prompt logits [len(prompt), V] and up to ``max_new_tokens`` greedy tokens.

    ``attention_backend``: "reference", "pallas" or "auto" (see :mod:`akv_jax.pallas.dispatch`).
    """
    rope = rope if rope is not None else rope_table_for(cfg)
    total = len(prompt) + max_new_tokens
    pages = bucket(-(-total // PAGE_SIZE), 1)
    dtype = params.embed.dtype
    kv = KVPool.zeros(cfg, pages, PAGE_SIZE, dtype)
    n = len(prompt)
    tpad = bucket(n, BLOCK_Q)
    tokens = np.zeros(tpad, np.int32)
    tokens[:n] = prompt
    pos = np.arange(tpad, dtype=np.int32)
    slots = np.where(pos < n, pos, pages * PAGE_SIZE).astype(np.int32)
    writes = KVWrites(slots=jnp.asarray(slots[None]), positions=jnp.asarray(pos[None]))
    batch = one_segment_batch(0, n, BLOCK_Q, pages)
    logits, kv = _step(
        params, cfg, jnp.asarray(tokens), jnp.asarray(pos), kv, writes, batch, rope, None, BLOCK_Q,
        attention_backend,
    )
    prompt_logits = np.asarray(logits[:n])
    out: list[int] = []
    nxt = int(np.argmax(prompt_logits[-1]))
    for i in range(max_new_tokens):
        out.append(nxt)
        if nxt in stop_ids or i == max_new_tokens - 1:
            break
        p = n + i
        one = jnp.asarray([p], jnp.int32)
        writes = KVWrites(slots=one[None], positions=one[None])
        batch = one_segment_batch(p, 1, 1, pages)
        logits, kv = _step(
            params, cfg, jnp.asarray([nxt], jnp.int32), one, kv, writes, batch, rope, None, 1,
            attention_backend,
        )
        nxt = int(np.argmax(np.asarray(logits[0])))
    return prompt_logits, out
