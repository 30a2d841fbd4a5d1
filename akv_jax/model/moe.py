"""Mixture-of-experts MLPs: GPT-OSS (biased top-k router, clamped-SwiGLU experts), Qwen3-MoE
(softmax router over all experts, plain SwiGLU experts, no biases) and MiniMax-M2 (sigmoid
router with a choice-only bias, plain SwiGLU experts, no biases).

Formulas follow transformers' ``GptOssTopKRouter`` / ``GptOssExperts``:

* router logits ``h @ router + router_bias``; the top-k logits are soft-maxed over the k
  (not over all experts);
* expert ``e``: ``gate = h @ Wg_e + bg_e``, ``up = h @ Wu_e + bu_e`` (HF stores both
  interleaved in ``gate_up_proj``; the converter splits them), then
  ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``,
  then ``@ Wd_e + bd_e``;
* the output is the routing-weighted sum over a token's k experts.

MiniMax-M2 (transformers' ``MiniMaxM2TopKRouter`` / ``MiniMaxM2Experts``, :func:`route_sigmoid`):

* scores ``sigmoid(float32(h @ router))`` over all experts; the top-k is chosen on
  ``scores + e_score_correction_bias`` (the bias only chooses), and the chosen experts are
  weighted by their *unbiased* scores divided by their sum (always renormalised; there is no
  routed scaling factor);
* expert ``e``: ``silu(h @ Wg_e) * (h @ Wu_e) @ Wd_e``, no biases (HF fuses gate and up as the
  two halves of ``gate_up_proj``, the released checkpoint stores ``w1``/``w3``/``w2`` per
  expert; the converter splits or stacks them).
Qwen3-MoE follows transformers' ``Qwen3MoeTopKRouter`` / ``Qwen3MoeExperts``: router logits
``h @ gate`` (no bias), soft-maxed in float32 over *all* experts, the top-k probabilities kept
and, when ``norm_topk_prob``, divided by their sum; expert ``e`` is
``(silu(h @ Wg_e) * (h @ Wu_e)) @ Wd_e`` of width ``moe_intermediate_size``.

The experts run as grouped matmuls (:func:`akv_jax.pallas.grouped_matmul.grouped_matmul`:
``jax.lax.ragged_dot`` on GPU and TPU, a tiled scan on the CPU, whose ragged_dot lowering is
a dense product over every expert) over the T*k (token, expert) pairs sorted by expert: work
is proportional to T*k, never T*E. The expert weights may be packed MXFP4
(:class:`~akv_jax.pallas.grouped_matmul.Mxfp4Weight`, ``--moe-weight-format mxfp4``); the grouped
matmul dequantises them per (row tile, expert).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from akv_jax.kernels.projection import XLA, Projection
from akv_jax.model.config import ModelConfig
from akv_jax.model.params import LayerParams
from akv_jax.model.row_sum import row_softmax, row_sum
from akv_jax.pallas.grouped_matmul import grouped_matmul


def route(cfg: ModelConfig, lp: LayerParams, logits: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
    """GPT-OSS's router on the logits ``h @ router`` [T, E]: (expert ids [T, k] int32,
    routing weights [T, k] float32)."""
    top, idx = jax.lax.top_k((logits + lp.router_bias).astype(jnp.float32),
                             cfg.num_experts_per_tok)
    return idx.astype(jnp.int32), row_softmax(top)


def route_sigmoid(cfg: ModelConfig, lp: LayerParams, logits: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """MiniMax-M2's router on the logits: (expert ids [T, k] int32, weights [T, k] float32)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    _, idx = jax.lax.top_k(scores + lp.router_score_bias.astype(jnp.float32),
                           cfg.num_experts_per_tok)
    chosen = jnp.take_along_axis(scores, idx, axis=-1)
    return idx.astype(jnp.int32), chosen / row_sum(chosen, keepdims=True)


def route_softmax_topk(cfg: ModelConfig, lp: LayerParams, logits: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
    """Qwen3-MoE's router on the logits: softmax over every expert in float32, top-k,
    optionally renormalised."""
    probs = row_softmax(logits.astype(jnp.float32))
    top, idx = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top = top / row_sum(top, keepdims=True)
    return idx.astype(jnp.int32), top


def clamped_swiglu(cfg: ModelConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    limit = cfg.swiglu_limit
    gate = jnp.minimum(gate, limit)  # clamped above only, as in transformers
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def _expert_bias(y: jax.Array, b: jax.Array | None, expert_of: jax.Array) -> jax.Array:
    return y if b is None else y + b[expert_of]


def moe_mlp(cfg: ModelConfig, lp: LayerParams, h: jax.Array, proj: Projection = XLA,
            live: jax.Array | None = None) -> jax.Array:
    """The MoE block on normed hidden states ``h`` [T, D] -> [T, D] (no residual). The router
    product runs on ``proj`` (a token's routing then does not depend on the rows beside it
    where the backend's products do not); ``live``: see ``forward.live_rows``."""
    T, K, E = h.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    router = (route_sigmoid if cfg.sigmoid_router
              else route_softmax_topk if cfg.arch == "qwen3_moe" else route)
    experts, weights = router(cfg, lp, proj("td,de->te", h, lp.router, live))
    flat = experts.reshape(-1)  # [T*K], pair i is (token i // K, its (i % K)-th expert)
    order = jnp.argsort(flat, stable=True)
    expert_of = flat[order]
    token_of = order // K
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = h[token_of]  # [T*K, D], grouped by expert
    gate = _expert_bias(grouped_matmul(xs, lp.expert_gate, group_sizes), lp.expert_gate_bias,
                        expert_of)
    up = _expert_bias(grouped_matmul(xs, lp.expert_up, group_sizes), lp.expert_up_bias, expert_of)
    # GPT-OSS clamps its SwiGLU; Qwen3-MoE and MiniMax-M2 use the plain one.
    act = (clamped_swiglu(cfg, gate, up) if cfg.arch == "gpt_oss"
           else jax.nn.silu(gate) * up).astype(h.dtype)
    out = _expert_bias(grouped_matmul(act, lp.expert_down, group_sizes), lp.expert_down_bias,
                       expert_of)
    out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
    return jnp.zeros((T, h.shape[1]), out.dtype).at[token_of].add(out).astype(h.dtype)
