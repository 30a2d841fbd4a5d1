"""Pure forward pass of Llama-3 / Qwen3 decoders over a segment batch and a paged KV pool.

One function serves every path: prefill, decode, one-pass restore and plain causal
prefill. Per layer it (1) computes q, k, v for the batch's tokens, (2) writes each token's
key, rotated to each of its requested positions, and its value into the pool, and (3) runs
segment-batch attention reading only the pool. Writing before attending is what lets a
segment see its own earlier tokens, and lets a restore keep several *position versions* of
the same token's key (one write per version).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from akv_jax.model.config import ModelConfig
from akv_jax.model.params import LayerParams, Params
from akv_jax.pallas.metadata import AttentionFn, SegmentBatch
from akv_jax.pallas.rotary import RopeTable, apply_rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    """Paged key/value storage for all layers. Keys are stored already rotated."""

    k: jax.Array  # [L, P, page_size, Hkv, Dh]
    v: jax.Array  # [L, P, page_size, Hkv, Dh]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def zeros(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> KVPool:
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        return KVPool(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVWrites:
    """Where each token's K/V goes: W versions per token (W >= 1).

    ``slots[w, t]`` is a flat pool slot (``page * page_size + offset``); a value outside the
    pool means "no write". ``positions[w, t]`` is the RoPE position of that copy of the key.
    """

    slots: jax.Array  # [W, T] int32
    positions: jax.Array  # [W, T] int32


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """transformers' RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def attention_inputs(
    cfg: ModelConfig, lp: LayerParams, x: jax.Array, q_positions: jax.Array, rope: RopeTable
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first half of a layer: (q rotated to ``q_positions``, k *unrotated*, v), [T, H, Dh]."""
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    q = jnp.einsum("td,dhk->thk", h, lp.wq)
    k = jnp.einsum("td,dhk->thk", h, lp.wk)
    v = jnp.einsum("td,dhk->thk", h, lp.wv)
    if cfg.qk_norm:
        q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    return apply_rope(q, q_positions, rope), k, v


def layer_output(cfg: ModelConfig, lp: LayerParams, x: jax.Array, attn: jax.Array) -> jax.Array:
    """The second half of a layer: output projection, residual, MLP, residual."""
    x = x + jnp.einsum("thk,hkd->td", attn.astype(x.dtype), lp.wo)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    gate = jnp.einsum("td,df->tf", h, lp.w_gate)
    up = jnp.einsum("td,df->tf", h, lp.w_up)
    return x + jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, lp.w_down)


def decoder_layer(
    cfg: ModelConfig,
    lp: LayerParams,
    x: jax.Array,
    k_all: jax.Array,
    v_all: jax.Array,
    layer: jax.Array,
    q_positions: jax.Array,
    writes: KVWrites,
    batch: SegmentBatch,
    rope: RopeTable,
    attention: AttentionFn,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Decoder layer ``layer`` on the all-layer pools [L, P, ps, Hkv, Dh]: (x, k_all, v_all).

    The writes go straight into the stacked pools and attention reads them with the layer
    index: slicing one layer out and setting it back would copy the whole layer pool twice
    per layer and step, which made step time grow with the pool size.
    """
    q, k, v = attention_inputs(cfg, lp, x, q_positions, rope)
    ps = k_all.shape[2]
    for w in range(writes.slots.shape[0]):  # W is small and static (position versions)
        kw = apply_rope(k, writes.positions[w], rope).astype(k_all.dtype)
        page, off = writes.slots[w] // ps, writes.slots[w] % ps  # slot P*ps -> page P: dropped
        k_all = k_all.at[layer, page, off].set(kw, mode="drop")
        v_all = v_all.at[layer, page, off].set(v.astype(v_all.dtype), mode="drop")
    attn = attention(q, k_all, v_all, batch, layer=layer)
    return layer_output(cfg, lp, x, attn), k_all, v_all


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    q_positions: jax.Array,
    kv: KVPool,
    writes: KVWrites,
    batch: SegmentBatch,
    rope: RopeTable,
    attention: AttentionFn,
    logits_rows: jax.Array | None = None,
) -> tuple[jax.Array, KVPool]:
    """Run the decoder on ``tokens`` [T] and return (float32 logits, updated pool).

    ``logits_rows`` [N] selects which rows get logits (all rows when None); prefill only
    needs the last row of each request, which saves the vocabulary matmul elsewhere.
    """
    x = params.embed[tokens]

    def body(carry, layer_in):
        x, k_all, v_all = carry
        lp, idx = layer_in
        x, k_all, v_all = decoder_layer(
            cfg, lp, x, k_all, v_all, idx, q_positions, writes, batch, rope, attention
        )
        return (x, k_all, v_all), None

    (x, k_all, v_all), _ = jax.lax.scan(
        body, (x, kv.k, kv.v), (params.layers, jnp.arange(cfg.num_layers))
    )
    if logits_rows is not None:
        x = x[logits_rows]
    return lm_logits(params, cfg, x), KVPool(k=k_all, v=v_all)


def lm_logits(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm and vocabulary projection of hidden states ``x`` [T, D] -> float32 [T, V]."""
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        # Contract against embed [V, D] directly: writing ``embed.T`` makes XLA's CPU backend
        # copy the whole transposed table on every call (3x slower decode head).
        logits = jnp.einsum("td,vd->tv", x, params.embed, preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("td,dv->tv", x, params.lm_head, preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32)
