"""The jitted training step: loss through the packed op histories, gradient, optax update.

What is trained is ``TrainState.trainable``: the whole :class:`Params` (full fine-tuning) or
a :class:`~akv_jax.train.lora.LoraParams` (LoRA-only, with the base params frozen in
``TrainState.frozen``). Differentiating with respect to that pytree alone is the trainable
mask: frozen weights get no gradient and no optimiser state.

Data and tensor parallelism use the serving code's placement rules: params by their logical
axes (:func:`akv_jax.model.params.shard_params`: heads and FFN width over ``"tensor"``), the
batch of packs split over ``"data"`` on its leading axis; XLA's SPMD partitioner derives the
collectives (the gradient all-reduce over ``"data"``, the matmul reductions over
``"tensor"``). A step is the same computation on any mesh (tests compare them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from akv_jax.model.config import ModelConfig
from akv_jax.model.params import Params, shard_params
from akv_jax.train.lora import LoraParams, adapt
from akv_jax.train.loss import loss_sums
from akv_jax.train.optim import OptimConfig, make_optimizer, schedule
from akv_jax.train.pack import PackedExample, PackShape


@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array  # [] int32 micro-steps taken (one per train_step call)
    trainable: Any  # Params (full fine-tuning) or LoraParams
    opt_state: Any  # optax state of ``trainable``
    frozen: Params | None = None  # base params of a LoRA run

    @property
    def is_lora(self) -> bool:
        return isinstance(self.trainable, LoraParams)


jax.tree_util.register_dataclass(
    TrainState, data_fields=["step", "trainable", "opt_state", "frozen"], meta_fields=[]
)


def model_params(trainable: Any, frozen: Params | None) -> Params:
    """The params the forward runs with: ``trainable`` itself, or the frozen base with the
    adapters applied unmerged."""
    if isinstance(trainable, LoraParams):
        if frozen is None:
            raise ValueError("a LoRA state needs the frozen base params")
        return adapt(frozen, trainable)
    return trainable


def init_state(trainable: Any, optim: OptimConfig, frozen: Params | None = None) -> TrainState:
    """A step-0 state (optimiser state built where ``trainable`` lives: on a mesh, it
    follows the params' shardings). ``trainable`` is copied: the step donates its state, and
    the caller's arrays must survive that."""
    trainable = jax.tree.map(jnp.copy, trainable)
    opt_state = jax.jit(make_optimizer(optim).init)(trainable)
    return TrainState(jnp.zeros((), jnp.int32), trainable, opt_state, frozen)


def shard_state(state: TrainState, cfg: ModelConfig, optim: OptimConfig, mesh: Mesh) -> TrainState:
    """``state`` placed on ``mesh``: params by the logical-axis rules, LoRA adapters and
    scalars replicated, the optimiser state where a fresh one built from the placed
    trainable tree lands (its moments follow their tensors' shardings)."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(tree):
        if isinstance(tree, Params):
            return shard_params(tree, cfg, mesh)
        return jax.tree.map(lambda x: jax.device_put(x, replicated), tree)

    trainable = place(state.trainable)
    frozen = None if state.frozen is None else place(state.frozen)
    layout = jax.jit(make_optimizer(optim).init)(trainable)

    def place_like(x, ref):
        # moments come out with their tensors' NamedShardings; the counters (made from
        # nothing inside the init) land on one device: replicate those
        sh = ref.sharding if isinstance(ref.sharding, NamedSharding) else replicated
        return jax.device_put(x, sh)

    opt_state = jax.tree.map(place_like, state.opt_state, layout)
    return TrainState(jax.device_put(state.step, replicated), trainable, opt_state, frozen)


def shard_batch(batch: PackedExample, mesh: Mesh) -> PackedExample:
    """A batch of packs split over the mesh's ``"data"`` axis (its leading axis)."""
    n = mesh.shape.get("data", 1)
    if batch.tokens.shape[0] % n:
        raise ValueError(f"batch of {batch.tokens.shape[0]} packs does not split over data={n}")
    sh = NamedSharding(mesh, PartitionSpec("data"))
    return jax.tree.map(lambda x: jax.device_put(x, sh), batch)


def make_train_step(
    cfg: ModelConfig, shape: PackShape, optim: OptimConfig, *, donate: bool = True
) -> Callable[[TrainState, PackedExample], tuple[TrainState, dict[str, jax.Array]]]:
    """``train_step(state, batch) -> (state, metrics)``, jitted. ``batch``: packs stacked on a
    leading axis. metrics: ``loss`` (mean over the batch's targets), ``tokens`` (targets),
    ``rows`` (real tokens computed), ``grad_norm`` (before clipping), ``lr`` (of this update).
    With accumulation, the optimiser applies the mean of ``accum_steps`` micro-batches'
    gradients every ``accum_steps``-th call (optax.MultiSteps)."""
    tx = make_optimizer(optim)
    lr_of = schedule(optim)

    def step(state: TrainState, frozen: Params | None, batch: PackedExample):
        def objective(trainable):
            params = model_params(trainable, frozen)
            total, count = loss_sums(params, cfg, batch, shape)
            return total / jnp.maximum(count, 1e-9), count

        (loss, count), grads = jax.value_and_grad(objective, has_aux=True)(state.trainable)
        updates, opt_state = tx.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        metrics = {
            "loss": loss,
            "tokens": count,
            "rows": (batch.row_trajectory >= 0).sum(),
            "grad_norm": optax.tree.norm(grads),
            "lr": lr_of(state.step // optim.accum_steps),
        }
        return TrainState(state.step + 1, trainable, opt_state), metrics

    # The frozen base is a separate, never donated argument: it outlives every step.
    jitted = jax.jit(step, donate_argnums=(0,) if donate else ())

    def train_step(state: TrainState, batch: PackedExample):
        new, metrics = jitted(dataclasses.replace(state, frozen=None), state.frozen, batch)
        return dataclasses.replace(new, frozen=state.frozen), metrics

    return train_step
