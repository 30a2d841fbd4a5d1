"""Next-token cross-entropy through op histories, in one forward pass per pack.

:func:`token_losses` runs the model once over a whole :class:`~akv_jax.train.pack.PackedExample`
(every message of every trajectory, each under its own view and positions: the one-pass
restore's forward) and scores each row's logits against its target (the pack's target
convention: row j predicts token j + 1 of its trajectory). :func:`loss` is the mean over the
weighted targets of a batch of packs.

**Attention in training: the jnp reference.** Of the three attention paths, only the
reference is reverse-differentiable as it stands: the chunked path (the CPU default for
inference) loops over a *dynamic* number of KV chunks per query block (``fori_loop`` with
traced bounds, i.e. a ``while_loop``: ``jax.grad`` raises "Reverse-mode differentiation does
not work for lax.while_loop or lax.fori_loop with dynamic start/stop values"), and the Pallas
kernels are ``pallas_call`` custom calls without a VJP (``jax.grad`` through the interpreted
GPU body fails too). The reference scores each query block against its whole view
(``lax.map`` over blocks), which is what a dense causal training step does anyway. Its
backward would keep every block's gathered view alive (blocks x view x heads), so the
attention call is rematerialised (``jax.checkpoint``): the backward recomputes one layer's
attention instead of storing it. The forward is
:func:`~akv_jax.model.forward.forward_uncached`: each layer attends to a pool of its own, so
no all-layer KV pool is carried through the layer scan (carried, its cotangent made the
backward sum a pool-sized array per layer; the figures are in docs/training.md).

:func:`op_by_op_token_losses` is the oracle the tests hold the one-pass loss to: the same
targets scored on logits from the incremental ops (append, drop, repos per segment,
as :class:`akv_jax.cache.core.CacheOps` runs them), differentiable too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.cache.core import append, drop, repos
from akv_jax.cache.state import CacheState
from akv_jax.model.config import ModelConfig
from akv_jax.model.forward import KVWrites, forward_uncached, make_model_attention
from akv_jax.model.params import Params
from akv_jax.model.rope import rope_table_for
from akv_jax.model.row_sum import row_logsumexp
from akv_jax.pallas.metadata import bucket
from akv_jax.pallas.rotary import RopeTable
from akv_jax.train.example import TrainTrajectory
from akv_jax.train.pack import PackedExample, PackShape

# The attention backend training differentiates through (module docstring).
TRAIN_BACKEND = "reference"


def train_attention(
    cfg: ModelConfig, shape: PackShape, backend: str = TRAIN_BACKEND, remat: bool = True
):
    """The attention the training forward uses: ``backend`` (the reference by default),
    rematerialised in the backward pass when ``remat``."""
    attn = make_model_attention(cfg, backend, shape.block_q)
    if not remat:
        return attn
    if not callable(attn):  # one function per layer type: not yet needed for training
        raise ValueError("remat of per-layer-type attention is not supported; pass remat=False")

    @jax.checkpoint
    def attention(q, k_pages, v_pages, batch, layer=None, sinks=None):
        return attn(q, k_pages, v_pages, batch, layer=layer, sinks=sinks)

    return attention


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-row ``-log softmax(logits)[target]`` in float32: [..., V], [...] -> [...]. The
    server's log-softmax (:func:`~akv_jax.model.row_sum.row_logsumexp`), so a row scores a
    served token with the negated bits of the log-prob the server returned for it."""
    logits = logits.astype(jnp.float32)
    lse = row_logsumexp(logits)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - picked


def pack_logits(
    params: Params,
    cfg: ModelConfig,
    ex: PackedExample,
    shape: PackShape,
    *,
    rope: RopeTable | None = None,
    attention=None,
) -> jax.Array:
    """float32 logits [T, V] of every row of one pack, from one forward pass."""
    rope = rope if rope is not None else rope_table_for(cfg)
    attention = attention if attention is not None else train_attention(cfg, shape)
    writes = KVWrites(slots=jnp.asarray(ex.write_slots), positions=jnp.asarray(ex.write_positions))
    return forward_uncached(
        params,
        cfg,
        jnp.asarray(ex.tokens),
        jnp.asarray(ex.q_positions),
        shape.num_pages,
        shape.page_size,
        writes,
        jax.tree.map(jnp.asarray, ex.segment_batch()),
        rope,
        attention,
    )


def token_losses(
    params: Params,
    cfg: ModelConfig,
    ex: PackedExample,
    shape: PackShape,
    *,
    rope: RopeTable | None = None,
    attention=None,
) -> jax.Array:
    """Weighted cross-entropy of every row of one pack [T] (0 where the weight is 0)."""
    logits = pack_logits(params, cfg, ex, shape, rope=rope, attention=attention)
    w = jnp.asarray(ex.weights, jnp.float32)
    # where, not a product: a padding row's logits are never part of the loss, not even as 0*x
    return jnp.where(w != 0, w * cross_entropy(logits, jnp.asarray(ex.targets)), 0.0)


def loss_sums(
    params: Params,
    cfg: ModelConfig,
    batch: PackedExample,
    shape: PackShape,
    *,
    rope: RopeTable | None = None,
    attention=None,
) -> tuple[jax.Array, jax.Array]:
    """(sum of weighted target losses, sum of weights) over a batch of packs (leading axis B;
    a single pack without one is a batch of one). One forward pass per pack, vmapped."""
    if np.ndim(batch.tokens) == 1:
        batch = jax.tree.map(lambda x: x[None], batch)
    rope = rope if rope is not None else rope_table_for(cfg)
    attention = attention if attention is not None else train_attention(cfg, shape)
    fn = functools.partial(token_losses, cfg=cfg, shape=shape, rope=rope, attention=attention)
    per_row = jax.vmap(lambda ex: fn(params, ex=ex))(batch)
    return per_row.sum(), jnp.asarray(batch.weights, jnp.float32).sum()


def loss(
    params: Params,
    cfg: ModelConfig,
    batch: PackedExample,
    shape: PackShape,
    *,
    rope: RopeTable | None = None,
    attention=None,
) -> jax.Array:
    """Mean next-token cross-entropy over the weighted targets of ``batch`` (weight-averaged
    over all its packs; 0 when it has no target)."""
    total, count = loss_sums(params, cfg, batch, shape, rope=rope, attention=attention)
    return total / jnp.maximum(count, 1e-9)


# ----------------------------------------------------------------------------- oracle


@functools.lru_cache(maxsize=16)
def _jitted_ops(cfg: ModelConfig, backend: str, block_q: int):
    """append / drop / repos, each jitted once per model (and differentiable)."""
    rope = rope_table_for(cfg)
    attn = make_model_attention(cfg, backend, block_q)
    app = jax.jit(functools.partial(append, cfg=cfg, rope=rope, attention=attn, block_q=block_q))
    return app, jax.jit(drop), jax.jit(functools.partial(repos, rope=rope))


def op_by_op_token_losses(
    params: Params,
    cfg: ModelConfig,
    traj: TrainTrajectory,
    *,
    block_q: int = 16,
    page_size: int = 16,
    backend: str = "reference",
    capacity: int | None = None,
    segment_pad: int | None = None,
) -> jax.Array:
    """The tests' oracle: the weighted target losses [T - 1] of one trajectory (entry j:
    token j + 1 predicted from token j), from logits of the incremental ops, each segment
    appended to the state the previous ops left, one jitted op at a time (differentiable in
    ``params``). ``capacity`` (default: the trajectory's length), 64 op rows and
    ``segment_pad`` (every segment padded to that many rows; default: its bucket) fix the
    shapes, so trajectories share the compiled ops (and their derivatives)."""
    app, drp, rep = _jitted_ops(cfg, backend, block_q)
    capacity = capacity if capacity is not None else traj.num_tokens
    max_ops = max(64, 2 * len(traj.segments) + sum(map(len, traj.history.drops.values())))
    state = CacheState.empty(cfg, capacity, page_size, max_ops=max_ops, dtype=params.embed.dtype)
    logits = []
    for s, seg in enumerate(traj.segments):
        pad = segment_pad if segment_pad is not None else bucket(len(seg), block_q)
        if pad < len(seg) or pad % block_q:
            raise ValueError(f"segment_pad={pad} must be a multiple of {block_q} >= {len(seg)}")
        arr = np.zeros(pad, np.int32)
        arr[: len(seg)] = seg
        lg, state = app(params, state, jnp.asarray(arr), len(seg))
        logits.append(lg[: len(seg)])
        if traj.history.drops_at(s):
            dropped = np.full(max(8, len(traj.history.drops_at(s))), -1, np.int32)
            dropped[: len(traj.history.drops_at(s))] = traj.history.drops_at(s)
            state = drp(state, jnp.asarray(dropped))
        if traj.history.repos_at(s):
            state = rep(state)
    tokens = np.concatenate([np.asarray(s, np.int32) for s in traj.segments])
    mask = np.concatenate([np.asarray(m, np.float32) for m in traj.loss_mask])
    ce = cross_entropy(jnp.concatenate(logits)[:-1], jnp.asarray(tokens[1:]))
    return jnp.where(mask[1:] != 0, mask[1:] * ce, 0.0)
