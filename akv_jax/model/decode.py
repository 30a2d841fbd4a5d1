"""Batched greedy decoding for plain causal generation, with the token loop on the device.

A helper for the decode benchmark and for plain (op-free) batched generation; the serving
engine decodes through the segment-batch forward instead. It computes what
:func:`~akv_jax.model.forward.forward` computes (same norms, RoPE tables, float32 softmax,
same order of operations), with three layout choices made for small-batch decode speed on a
CPU, each measured on SmolLM2-135M with XLA's CPU backend:

* **Feature-major activations.** Hidden states are ``[D, N]`` (one column per token) and
  weights ``[out, in]``, so every projection is ``W @ X``. With N = 8 rows XLA's CPU matmul
  takes half the CPU time in this orientation than as ``X @ W`` (measured on the MLP chain:
  ~50 ms vs ~105 ms of CPU per step); at N = 1 the two are equal.
* **Per-layer weights, unrolled layers** (:func:`to_decode_model`). Inside ``lax.scan`` XLA
  copies each layer's weights out of the stacked array before every matmul, which doubles the
  memory traffic of a weight-bound decode step.
* **A dense per-sequence cache** per layer: keys ``[B, Hkv, S, Dh]`` (stored rotated) and values
  ``[B, Hkv, Dh, S]``. Attention is two batched matmuls whose batch axes (sequence, kv head)
  lead and whose contracted axis is minor, so the cache is never transposed or gathered.

All decode steps run in one jit-compiled ``lax.fori_loop``: no step returns to the host. A query
at position p sees the cached keys at positions <= p of its own sequence.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.model.config import ModelConfig
from akv_jax.model.params import Params
from akv_jax.model.rope import RopeTable, rope_table_for

CACHE_ALIGN = 64  # cache length granularity (bounds recompiles across prompt lengths)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeLayer:
    """One layer's weights as ``[out, in]`` matrices (Hugging Face's Linear layout)."""

    attn_norm: jax.Array  # [D]
    wq: jax.Array  # [Hq*Dh, D]
    wk: jax.Array  # [Hkv*Dh, D]
    wv: jax.Array  # [Hkv*Dh, D]
    wo: jax.Array  # [D, Hq*Dh]
    q_norm: jax.Array | None  # [Dh]
    k_norm: jax.Array | None  # [Dh]
    mlp_norm: jax.Array  # [D]
    w_gate: jax.Array  # [F, D]
    w_up: jax.Array  # [F, D]
    w_down: jax.Array  # [D, F]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeModel:
    embed: jax.Array  # [V, D]
    layers: tuple[DecodeLayer, ...]
    final_norm: jax.Array  # [D]
    head: jax.Array  # [V, D]: lm_head.T, or the embedding when tied


def to_decode_model(params: Params) -> DecodeModel:
    """Per-layer ``[out, in]`` weights from the stacked Params (once, outside jit)."""
    ly = params.layers
    L, D = ly.attn_norm.shape

    def one(i: int) -> DecodeLayer:
        def opt(a):
            return None if a is None else a[i]

        return DecodeLayer(
            attn_norm=ly.attn_norm[i],
            wq=ly.wq[i].reshape(D, -1).T,
            wk=ly.wk[i].reshape(D, -1).T,
            wv=ly.wv[i].reshape(D, -1).T,
            wo=ly.wo[i].reshape(-1, D).T,
            q_norm=opt(ly.q_norm),
            k_norm=opt(ly.k_norm),
            mlp_norm=ly.mlp_norm[i],
            w_gate=ly.w_gate[i].T,
            w_up=ly.w_up[i].T,
            w_down=ly.w_down[i].T,
        )

    # jnp.array(copy) so each transposed matrix is its own contiguous buffer.
    layers = tuple(jax.tree.map(jnp.array, one(i)) for i in range(L))
    head = params.embed if params.lm_head is None else jnp.array(params.lm_head.T)
    return DecodeModel(params.embed, layers, params.final_norm, head)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """The dense caches of B sequences and where each one is."""

    k: tuple[jax.Array, ...]  # per layer [B, Hkv, S, Dh], keys rotated to their positions
    v: tuple[jax.Array, ...]  # per layer [B, Hkv, Dh, S] (slot axis minor, see module doc)
    positions: jax.Array  # [B] int32 position of the next input token
    tokens: jax.Array  # [B] int32 next input token


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int) -> jax.Array:
    """forward.rms_norm over ``axis`` (normalise in float32, cast back, then scale)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    shape = [1] * x.ndim
    shape[axis] = -1
    return weight.reshape(shape) * xf.astype(x.dtype)


def _rope(x: jax.Array, pos: jax.Array, rope: RopeTable) -> jax.Array:
    """Rotate ``x`` [H, Dh, N] (half-split pairs) to positions ``pos`` [N], in float32."""
    half = x.shape[1] // 2
    c, s = rope.cos[pos].T[None], rope.sin[pos].T[None]  # [1, Dh/2, N]
    x1, x2 = x[:, :half].astype(jnp.float32), x[:, half:].astype(jnp.float32)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=1).astype(x.dtype)


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, sm_scale: float
) -> jax.Array:
    """Causal attention of queries ``q`` [B, T, Hq, Dh] at positions ``q_pos`` [B, T] over
    caches ``k`` [B, Hkv, S, Dh] and ``v`` [B, Hkv, Dh, S]: slot s is visible to a query at
    position p iff s <= p. Float32 softmax, like the segment-attention reference."""
    B, T, Hq, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, Dh).astype(jnp.float32)
    s = jnp.einsum("bthgd,bhsd->bhgts", qg, k.astype(jnp.float32)) * sm_scale
    mask = (jnp.arange(S)[None, None, :] <= q_pos[:, :, None])[:, None, None]  # [B,1,1,T,S]
    s = jnp.where(mask, s, -1e30)
    p = jnp.where(mask, jnp.exp(s - s.max(-1, keepdims=True)), 0.0)
    o = jnp.einsum("bhgts,bhds->bthgd", p, v.astype(jnp.float32))
    denom = jnp.maximum(p.sum(-1), 1e-30).transpose(0, 3, 1, 2)[..., None]  # [B,T,Hkv,G,1]
    return (o / denom).reshape(B, T, Hq, Dh).astype(q.dtype)


def _write(cache: jax.Array, new: jax.Array, q_pos: jax.Array, axis: int) -> jax.Array:
    """Write ``new`` (the cache's layout, T slots on ``axis``) at ``q_pos`` [B, T] per row.

    A decode step (T = 1) is one in-place ``dynamic_update_slice`` per row.
    """
    new = new.astype(cache.dtype)
    B, T = q_pos.shape
    if T == 1:
        for b in range(B):
            start = [b, 0, 0, 0]
            start[axis] = q_pos[b, 0]
            cache = jax.lax.dynamic_update_slice(cache, new[b : b + 1], start)
        # Materialise the update once: otherwise XLA fuses the update into both of its users
        # (attention and the loop carry), and each fused copy first copies the whole cache.
        return jax.lax.optimization_barrier(cache)
    rows = jnp.arange(B)[:, None]
    idx = (rows, slice(None), q_pos) if axis == 2 else (rows, slice(None), slice(None), q_pos)
    # Advanced indices (rows, q_pos) go first in the update: [B, T, ...the other axes].
    moved = jnp.moveaxis(new, axis, 1)
    return cache.at[idx].set(moved)


def _layer(cfg: ModelConfig, lp: DecodeLayer, x, k_cache, v_cache, q_pos, rope):
    """One layer on feature-major ``x`` [D, B*T] for tokens at ``q_pos`` [B, T]."""
    B, T = q_pos.shape
    Hq, Hkv, Dh, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    flat_pos = q_pos.reshape(-1)
    h = _rms_norm(x, lp.attn_norm, eps, axis=0)
    q = (lp.wq @ h).reshape(Hq, Dh, B * T)
    k = (lp.wk @ h).reshape(Hkv, Dh, B * T)
    v = (lp.wv @ h).reshape(Hkv, Dh, B * T)
    if cfg.qk_norm:
        q = _rms_norm(q, lp.q_norm, eps, axis=1)
        k = _rms_norm(k, lp.k_norm, eps, axis=1)
    q, k = _rope(q, flat_pos, rope), _rope(k, flat_pos, rope)
    k_cache = _write(k_cache, k.reshape(Hkv, Dh, B, T).transpose(2, 0, 3, 1), q_pos, axis=2)
    v_cache = _write(v_cache, v.reshape(Hkv, Dh, B, T).transpose(2, 0, 1, 3), q_pos, axis=3)
    q_tok = q.reshape(Hq, Dh, B, T).transpose(2, 3, 0, 1)  # [B, T, Hq, Dh]
    attn = dense_attention(q_tok, k_cache, v_cache, q_pos, Dh**-0.5)
    attn = attn.reshape(B * T, Hq * Dh).T.astype(x.dtype)  # [Hq*Dh, B*T]
    x = x + lp.wo @ attn
    h = _rms_norm(x, lp.mlp_norm, eps, axis=0)
    x = x + lp.w_down @ (jax.nn.silu(lp.w_gate @ h) * (lp.w_up @ h))
    return x, k_cache, v_cache


def _run(model: DecodeModel, cfg: ModelConfig, tokens, q_pos, k, v, rope):
    """tokens, q_pos [B, T] -> feature-major final hidden states [D, B*T] and new caches."""
    x = model.embed[tokens.reshape(-1)].T
    k_out, v_out = [], []
    for lp, kl, vl in zip(model.layers, k, v, strict=True):
        x, kl, vl = _layer(cfg, lp, x, kl, vl, q_pos, rope)
        k_out.append(kl)
        v_out.append(vl)
    return x, tuple(k_out), tuple(v_out)


def _logits(model: DecodeModel, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Feature-major hidden states [D, N] -> float32 logits [V, N]."""
    h = _rms_norm(x, model.final_norm, cfg.rms_norm_eps, axis=0)
    return jnp.matmul(model.head, h, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "cache_len"))
def _prefill(model, cfg, tokens, lengths, rope, cache_len):
    B, T = tokens.shape
    dtype = model.embed.dtype
    k_shape = (B, cfg.num_kv_heads, cache_len, cfg.head_dim)
    v_shape = (B, cfg.num_kv_heads, cfg.head_dim, cache_len)
    k = tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers))
    v = tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers))
    q_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x, k, v = _run(model, cfg, tokens, q_pos, k, v, rope)
    # Padding after a shorter prompt is written to slots at positions >= its length; decode
    # overwrites each such slot before any query can see it (queries see slots <= their own).
    last = x.reshape(-1, B, T)[:, jnp.arange(B), lengths - 1]  # [D, B]
    logits = _logits(model, cfg, last).T  # [B, V]
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return logits, DecodeState(k, v, lengths, first)


def prefill(
    model: DecodeModel,
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    rope: RopeTable | None = None,
) -> tuple[jax.Array, DecodeState]:
    """Run every prompt through the model: (last-token logits [B, V], the decode state whose
    ``tokens`` are each prompt's greedy next token), with room for ``max_new_tokens`` more."""
    rope = rope if rope is not None else rope_table_for(cfg)
    lens = [len(p) for p in prompts]
    if not prompts or min(lens) < 1:
        raise ValueError("every prompt needs at least one token")
    T = max(lens)
    cache_len = -(-(T + max_new_tokens) // CACHE_ALIGN) * CACHE_ALIGN
    if T + max_new_tokens > rope.max_positions:
        raise ValueError(f"{T} + {max_new_tokens} tokens exceed the model's positions")
    tokens = np.zeros((len(prompts), T), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    return _prefill(model, cfg, jnp.asarray(tokens), jnp.asarray(lens, jnp.int32), rope, cache_len)


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps"), donate_argnames=("state",))
def decode_steps(
    model: DecodeModel, cfg: ModelConfig, state: DecodeState, rope: RopeTable, num_steps: int
) -> tuple[jax.Array, DecodeState]:
    """``num_steps`` greedy steps for every sequence: (tokens [B, num_steps], new state).

    Step i feeds the current token (``state.tokens`` first) and emits the argmax of its logits.
    The caller must have made room (``prefill``'s ``max_new_tokens``) for the steps.
    """
    B = state.tokens.shape[0]

    def step(i, carry):
        st, out = carry
        x, k, v = _run(model, cfg, st.tokens[:, None], st.positions[:, None], st.k, st.v, rope)
        nxt = jnp.argmax(_logits(model, cfg, x), axis=0).astype(jnp.int32)
        out = out.at[:, i].set(nxt)
        return DecodeState(k, v, st.positions + 1, nxt), out

    out = jnp.zeros((B, num_steps), jnp.int32)
    state, out = jax.lax.fori_loop(0, num_steps, step, (state, out))
    return out, state


def greedy_generate_batch(
    model: DecodeModel | Params,
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    rope: RopeTable | None = None,
) -> np.ndarray:
    """[B, max_new_tokens] greedy tokens for every prompt (no stopping on EOS)."""
    if isinstance(model, Params):
        model = to_decode_model(model)
    rope = rope if rope is not None else rope_table_for(cfg)
    _, state = prefill(model, cfg, prompts, max_new_tokens, rope)
    first = np.asarray(state.tokens)[:, None]
    if max_new_tokens == 1:
        return first
    rest, _ = decode_steps(model, cfg, state, rope, max_new_tokens - 1)
    return np.concatenate([first, np.asarray(rest)], axis=1)
