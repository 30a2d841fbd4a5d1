"""Pure forward pass of Llama-3 / Qwen3 / GPT-OSS / MiniMax-M2 decoders over a segment batch
and a paged KV pool.

One function serves every path: prefill, decode, one-pass restore and plain causal
prefill. Per layer it (1) computes q, k, v for the batch's tokens, (2) writes each token's
key, rotated to each of its requested positions, and its value into the pool, and (3) runs
segment-batch attention reading only the pool. Writing before attending is what lets a
segment see its own earlier tokens, and lets a restore keep several *position versions* of
the same token's key (one write per version).

GPT-OSS adds attention biases, per-head sinks (passed to attention per layer), a MoE MLP
(:mod:`akv_jax.model.moe`), YaRN's attention factor (applied to q and k in their rotation, as
transformers does, so stored keys carry it once and a repos by the unscaled table stays exact:
DESIGN §2.1) and two layer types with different windows: attention is then one function per
layer type (:class:`AttentionByType`) and the scan runs over groups of consecutive layers
whose types repeat (one group = one period of ``layer_types``), so each layer of a group
calls its own static function.

MiniMax-M2 adds a q/k RMSNorm over all heads at once (:func:`rms_norm_over_heads`), partial
rotary (the RoPE table's width: only the rotary dims of q and k rotate, here and in repos)
and the sigmoid-routed MoE (:mod:`akv_jax.model.moe`).
Qwen3-MoE mixes dense-MLP and MoE layers (``mlp_only_layers``, ``decoder_sparse_step``): a
layer's *kind* is its (attention type, MoE or dense) pair, the period is that of the kinds,
and each layer of a group takes its MLP weights from the dense or the expert stack (stacked
over the layers of their kind only, :func:`akv_jax.model.params.stack_layers`) at its static
row within the group. Kinds with no period (e.g. only layer 0 dense) make one group of all
layers, unrolled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from akv_jax.kernels.projection import LayerIndexed, Projection
from akv_jax.model.config import ModelConfig
from akv_jax.model.moe import moe_mlp
from akv_jax.model.params import LayerParams, Params, stack_layers
from akv_jax.model.row_sum import row_mean
from akv_jax.pallas.dispatch import make_attention_fn, make_projection
from akv_jax.pallas.metadata import AttentionFn, SegmentBatch
from akv_jax.pallas.rotary import RopeTable, apply_rope, rerotate, rotate_half_split


@dataclasses.dataclass(frozen=True)
class AttentionByType:
    """One attention function per layer type (a tuple, so hashable: a static jit argument)."""

    fns: tuple[tuple[str, AttentionFn], ...]

    def __getitem__(self, layer_type: str) -> AttentionFn:
        return dict(self.fns)[layer_type]


Attention = AttentionFn | AttentionByType


def make_model_attention(cfg: ModelConfig, backend: str, block_q: int, **kw) -> Attention:
    """The attention the forward of ``cfg`` takes: one function, or one per layer type (each
    layer type's sliding window is static in its function)."""
    types = sorted(set(cfg.layer_types or ("full_attention",)))
    scale = cfg.head_dim**-0.5
    fns = tuple(
        (t, make_attention_fn(backend, block_q=block_q, sm_scale=scale,
                              sliding_window=cfg.window_for(t), **kw))
        for t in types
    )
    return fns[0][1] if len(fns) == 1 else AttentionByType(fns)


def attention_for(attention: Attention, layer_type: str) -> AttentionFn:
    return attention[layer_type] if isinstance(attention, AttentionByType) else attention


def layer_kind(cfg: ModelConfig, i: int) -> tuple[str, bool]:
    """What makes layer ``i``'s body differ: (attention type, MoE MLP or not)."""
    return cfg.layer_type(i), cfg.is_moe_layer(i)


def layer_period(cfg: ModelConfig) -> int:
    """The smallest p dividing the layer count with the layer kinds (``layer_types`` and the
    MLP kind) repeating every p."""
    kinds, n = [layer_kind(cfg, i) for i in range(cfg.num_layers)], cfg.num_layers
    for p in range(1, n + 1):
        if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)):
            return p
    return n


def _grouped_layers(cfg: ModelConfig, layers: LayerParams, period: int) -> LayerParams:
    """Every stack reshaped to [groups, rows per group, ...] (the rows of a field stacked over
    one MLP kind are that kind's layers of the group, in order)."""
    groups = cfg.num_layers // period
    return jax.tree.map(lambda a: a.reshape(groups, a.shape[0] // groups, *a.shape[1:]), layers)


def _group_layer(cfg: ModelConfig, lps: LayerParams, period: int, j: int) -> LayerParams:
    """Layer ``j`` of a group (from :func:`_grouped_layers`): each field at the row of layer
    ``j`` in its stack, None where layer ``j`` has no such weight."""
    out = {}
    for f in dataclasses.fields(LayerParams):
        rows = [i for i in stack_layers(cfg, f.name) if i < period]  # group 0 is representative
        v = getattr(lps, f.name)
        if v is None or j not in rows:
            out[f.name] = None
        else:
            r = rows.index(j)
            out[f.name] = jax.tree.map(lambda a, r=r: a[r], v)
    return LayerParams(**out)


# The projection weights, with how many leading axes of each a projection contracts
# (wo [Hq, Dh, D] contracts its heads and head dim): what a backend's layout may repack.
PROJECTION_IN_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


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
    pool means "no write". ``positions[w, t]`` is the RoPE position of that copy of the key;
    version ``w > 0`` is version ``w - 1`` re-rotated to it (a hop of one chain: a version that
    is not written still carries its position).
    """

    slots: jax.Array  # [W, T] int32
    positions: jax.Array  # [W, T] int32


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, scale_in_f32: bool = False) -> jax.Array:
    """transformers' RMSNorm: normalise in float32, cast back, then scale (Llama, Qwen3), or
    scale in float32, then cast back (``scale_in_f32``: GPT-OSS)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(row_mean(xf * xf, keepdims=True) + eps)
    if scale_in_f32:
        return (weight.astype(jnp.float32) * xf).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def rms_norm_over_heads(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """MiniMax-M2's q/k norm: transformers' RMSNorm over the whole projection ``x`` [T, H, Dh]
    (all heads at once, weight [H, Dh]), before the split into heads. Under tensor
    parallelism the heads are sharded: the mean over them is a cross-shard reduction, which
    GSPMD inserts (an all-reduce of [T] partial sums per norm)."""
    xf = x.astype(jnp.float32)
    sq = (xf * xf).reshape(*x.shape[:-2], -1)
    ms = row_mean(sq, keepdims=True)[..., None]
    return weight * (xf * jax.lax.rsqrt(ms + eps)).astype(x.dtype)


def _norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_scale_in_float32)


def rope_scaled(x: jax.Array, positions: jax.Array, rope: RopeTable, scale: float) -> jax.Array:
    """``apply_rope`` with transformers' attention factor on cos and sin (YaRN; 1.0 else)."""
    if scale == 1.0:
        return apply_rope(x, positions, rope)
    return rotate_half_split(x, rope.cos[positions] * scale, rope.sin[positions] * scale)


def _bias(y: jax.Array, b: jax.Array | None) -> jax.Array:
    return y if b is None else y + b


def attention_inputs(
    cfg: ModelConfig, lp: LayerParams, x: jax.Array, q_positions: jax.Array, rope: RopeTable,
    live: jax.Array | None, proj: Projection,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first half of a layer: (q rotated to ``q_positions``, k *unrotated*, v), [T, H, Dh].
    ``live``: see :func:`live_rows`; ``proj``: the projection backend."""
    h = _norm(cfg, x, lp.attn_norm)
    q = _bias(proj("td,dhk->thk", h, lp.wq, live), lp.bq)
    k = _bias(proj("td,dhk->thk", h, lp.wk, live), lp.bk)
    v = _bias(proj("td,dhk->thk", h, lp.wv, live), lp.bv)
    if cfg.qk_norm:
        q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    elif cfg.qk_norm_over_heads:
        q = rms_norm_over_heads(q, lp.q_norm, cfg.rms_norm_eps)
        k = rms_norm_over_heads(k, lp.k_norm, cfg.rms_norm_eps)
    return rope_scaled(q, q_positions, rope, cfg.rope.attention_scaling()), k, v


def layer_output(cfg: ModelConfig, lp: LayerParams, x: jax.Array, attn: jax.Array,
                 live: jax.Array | None, proj: Projection) -> jax.Array:
    """The second half of a layer: output projection, residual, MLP (or MoE), residual. The
    layer is MoE when ``lp`` holds a router. ``live``: see :func:`live_rows`."""
    attn = attn.astype(x.dtype)
    if lp.bo is None:
        x = proj.add("thk,hkd->td", attn, lp.wo, x, live)
    else:
        x = x + _bias(proj("thk,hkd->td", attn, lp.wo, live), lp.bo)
    h = _norm(cfg, x, lp.mlp_norm)
    if lp.router is not None:
        return x + moe_mlp(cfg, lp, h, proj, live)
    gate = proj("td,df->tf", h, lp.w_gate, live)
    act = proj.gated(h, lp.w_up, gate, live)
    return proj.add("tf,fd->td", act, lp.w_down, x, live)


def live_rows(batch: SegmentBatch) -> jax.Array:
    """The end of the last query block's rows: rows past it are a step's padding (its
    tokens padded to the next bucket), which no block reads and whose keys and values are
    written nowhere, so their hidden states may be anything; the projections skip them
    (a backend's ``live``). Every row a block reads lies before it."""
    ends = jnp.where(batch.block_seg >= 0, batch.block_q_start + batch.block_q_len, 0)
    return jnp.max(ends).astype(jnp.int32)


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
    proj: Projection,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Decoder layer ``layer`` on the all-layer pools [L, P, ps, Hkv, Dh]: (x, k_all, v_all).

    The writes go straight into the stacked pools and attention reads them with the layer
    index: slicing one layer out and setting it back would copy the whole layer pool twice
    per layer and step, which made step time grow with the pool size.
    """
    live = live_rows(batch)
    q, k, v = attention_inputs(cfg, lp, x, q_positions, rope, live, proj)
    ps = k_all.shape[2]
    kw = None
    for w in range(writes.slots.shape[0]):  # W is small and static (position versions)
        # Version w is version w-1 re-rotated, as a pre-pass copy makes it from a resident
        # version: one canonical form of each version's bits, however it was made.
        if kw is None:
            kw = rope_scaled(k, writes.positions[0], rope, cfg.rope.attention_scaling())
        else:
            kw = rerotate(kw, writes.positions[w - 1], writes.positions[w], rope)
        kw = kw.astype(k_all.dtype)
        page, off = writes.slots[w] // ps, writes.slots[w] % ps  # slot P*ps -> page P: dropped
        k_all = k_all.at[layer, page, off].set(kw, mode="drop")
        v_all = v_all.at[layer, page, off].set(v.astype(v_all.dtype), mode="drop")
    if lp.sinks is None:
        attn = attention(q, k_all, v_all, batch, layer=layer)
    else:
        attn = attention(q, k_all, v_all, batch, layer=layer, sinks=lp.sinks)
    return layer_output(cfg, lp, x, attn, live, proj), k_all, v_all


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    q_positions: jax.Array,
    kv: KVPool,
    writes: KVWrites,
    batch: SegmentBatch,
    rope: RopeTable,
    attention: Attention,
    logits_rows: jax.Array | None = None,
    projection: Projection | None = None,
) -> tuple[jax.Array, KVPool]:
    """Run the decoder on ``tokens`` [T] and return (float32 logits, updated pool).

    ``attention``: one function for every layer, or an :class:`AttentionByType` (see
    :func:`make_model_attention`). ``logits_rows`` [N] selects which rows get logits (all
    rows when None); prefill only needs the last row of each request, which saves the
    vocabulary matmul elsewhere. ``projection``: the backend of every product by a weight
    (default: the platform's, ``akv_jax.pallas.dispatch.make_projection``), which takes
    ``params`` in its layout.

    The layers run as a scan over ``params.layers``' stacks; a weight the backend reads in
    place (:class:`~akv_jax.kernels.projection.LayerIndexed`) is not sliced.
    """
    proj = projection or make_projection()
    x = params.embed[tokens]

    def run(lp, idx, fn: AttentionFn, carry):
        return decoder_layer(cfg, lp, *carry, idx, q_positions, writes, batch, rope, fn, proj)

    x, k_all, v_all = _scan_layers(cfg, params.layers, attention, run, (x, kv.k, kv.v))
    if logits_rows is not None:
        x = x[logits_rows]
    return lm_logits(params, cfg, x, proj), KVPool(k=k_all, v=v_all)


def forward_uncached(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    q_positions: jax.Array,
    num_pages: int,
    page_size: int,
    writes: KVWrites,
    batch: SegmentBatch,
    rope: RopeTable,
    attention: Attention,
    projection: Projection | None = None,
) -> jax.Array:
    """:func:`forward` from an empty pool whose KV is not kept (training): float32 logits
    [T, V] of every row.

    Each layer writes its keys and values into a one-layer pool of its own and attends to it.
    The result equals :func:`forward`'s (layer l only ever reads what layer l wrote), but
    nothing of size layers x pool is carried through the layer scan: differentiated, a
    carried all-layer pool makes the backward save and sum a full pool-sized cotangent per
    layer, which made a SmolLM2 training step ~35x its forward and ran out of memory.
    """
    proj = projection or make_projection()
    dtype = params.embed.dtype
    shape = (1, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    layer0 = jnp.zeros((), jnp.int32)

    def run(lp, idx, fn: AttentionFn, x):
        k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
        x, _, _ = decoder_layer(cfg, lp, x, k, v, layer0, q_positions, writes, batch, rope, fn,
                                proj)
        return x

    x = _scan_layers(cfg, params.layers, attention, run, params.embed[tokens])
    return lm_logits(params, cfg, x, proj)


def _layer_attention(cfg: ModelConfig, attention: Attention) -> list[AttentionFn]:
    """The attention function of each layer of one period (see :func:`layer_period`)."""
    return [attention_for(attention, cfg.layer_type(j)) for j in range(layer_period(cfg))]


def _scan_layers(cfg: ModelConfig, layers: LayerParams, attention: Attention, run, carry):
    """``carry = run(layer params, layer index, attention fn, carry)`` for every layer, as a
    scan over the stacked layers (over groups of one period when the layer kinds alternate:
    each layer in a group has its own static attention function (its window) and its MLP
    weights from its kind's stack; the group body is unrolled). A backend's weights read in
    place (:class:`~akv_jax.kernels.projection.LayerIndexed`) are not sliced: each layer that
    has the field gets ``field.at(layer index)``."""
    fns = _layer_attention(cfg, attention)
    period = len(fns)
    in_place = {f.name: getattr(layers, f.name) for f in dataclasses.fields(LayerParams)
                if isinstance(getattr(layers, f.name), LayerIndexed)}
    layers = dataclasses.replace(layers, **dict.fromkeys(in_place))
    # The fields each position of a group has (group 0 is representative).
    holds = [[name for name in in_place if j in stack_layers(cfg, name)] for j in range(period)]

    def layer_params(lp: LayerParams, j: int, idx) -> LayerParams:
        if not holds[j]:
            return lp
        return dataclasses.replace(lp, **{name: in_place[name].at(idx) for name in holds[j]})

    if period == 1:

        def body(carry, layer_in):
            lp, idx = layer_in
            return run(layer_params(lp, 0, idx), idx, fns[0], carry), None

        xs = (layers, jnp.arange(cfg.num_layers))
    else:

        def body(carry, group_in):
            lps, g = group_in
            for j in range(period):
                idx = g * period + j
                lp = layer_params(_group_layer(cfg, lps, period, j), j, idx)
                carry = run(lp, idx, fns[j], carry)
            return carry, None

        groups = cfg.num_layers // period
        xs = (_grouped_layers(cfg, layers, period), jnp.arange(groups))
    carry, _ = jax.lax.scan(body, carry, xs)
    return carry


def lm_logits(params: Params, cfg: ModelConfig, x: jax.Array,
              projection: Projection | None = None) -> jax.Array:
    """Final norm and vocabulary projection of hidden states ``x`` [T, D] -> float32 [T, V]
    (tied embeddings: against ``embed`` [V, D] itself)."""
    proj = projection or make_projection()
    x = _norm(cfg, x, params.final_norm)
    if params.lm_head is None:
        return proj.head(x, params.embed, tied=True)
    return proj.head(x, params.lm_head, tied=False)
