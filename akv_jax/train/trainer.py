"""The command line's training run: model, packer, train state and its jitted step, evaluation
under both views, checkpoints and the export for serving. Glue over the core modules
(:mod:`~akv_jax.train.pack`, :mod:`~akv_jax.train.loss`, :mod:`~akv_jax.train.lora`,
:mod:`~akv_jax.train.optim`, :mod:`~akv_jax.train.step`, :mod:`~akv_jax.train.checkpoint`);
:mod:`akv_jax.train.cli` drives it."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from akv_jax.train.checkpoint import TrainCheckpointer, export_for_serving
from akv_jax.train.data import CorePacker
from akv_jax.train.example import TrainTrajectory
from akv_jax.train.lora import init_lora
from akv_jax.train.loss import loss_sums
from akv_jax.train.optim import OptimConfig
from akv_jax.train.pack import PackShape
from akv_jax.train.step import (
    TrainState,
    init_state,
    make_train_step,
    model_params,
    shard_batch,
    shard_state,
)
from converters.loading import LoadedModel


def optim_config(args: argparse.Namespace) -> OptimConfig:
    """The command line's optimiser: ``--steps`` micro-steps are ``--steps / --accum``
    updates; warmup defaults to a tenth of them."""
    updates = -(-args.steps // args.accum)
    warmup = args.warmup if args.warmup is not None else max(1, updates // 10)
    return OptimConfig(
        lr=args.lr,
        warmup_steps=warmup,
        total_steps=updates,
        weight_decay=args.weight_decay,
        clip_norm=args.clip,
        accum_steps=args.accum,
    )


class Trainer:
    def __init__(self, model: LoadedModel, args: argparse.Namespace, mesh: Mesh | None = None):
        """``mesh``: a ("data", "tensor") mesh to train on (params by the serving sharding
        rules, each batch split over "data"); None: one device."""
        self.model, self.cfg = model, model.cfg
        self.shape = PackShape(
            max_tokens=args.max_tokens,
            max_segments=args.max_segments,
            max_trajectories=args.max_trajectories,
            max_versions=args.max_versions,
        )
        self.packer = CorePacker(self.shape)
        optim = optim_config(args)
        if args.lora_rank:
            lora = init_lora(
                model.params, rank=args.lora_rank, alpha=args.lora_alpha, seed=args.seed
            )
            self.state: TrainState = init_state(lora, optim, frozen=model.params)
        else:
            self.state = init_state(model.params, optim)
        self.mesh = mesh
        if mesh is not None:
            self.state = shard_state(self.state, self.cfg, optim, mesh)
        self._step = make_train_step(self.cfg, self.shape, optim)
        cfg, shape = self.cfg, self.shape
        self._sums = jax.jit(
            lambda trainable, frozen, b: loss_sums(model_params(trainable, frozen), cfg, b, shape)
        )

    def step(self, batch: Any) -> tuple[float, int]:
        """One micro-step on ``batch``: (its mean target loss, its real tokens)."""
        if self.mesh is not None:
            batch = shard_batch(batch, self.mesh)
        self.state, metrics = self._step(self.state, batch)
        return float(metrics["loss"]), int(metrics["rows"])

    def evaluate(self, views: Mapping[str, Sequence[TrainTrajectory]]) -> dict[str, float]:
        """``eval_loss_<view>``: mean target loss over each view's trajectories (grouped
        first-fit, one pack at a time)."""
        out = {}
        for name, trajs in views.items():
            total = count = 0.0
            for group in self.packer.group(trajs):
                ex = self.packer.batch([self.packer.pack([trajs[i] for i in group])])
                t, c = self._sums(self.state.trainable, self.state.frozen, ex)
                total, count = total + float(t), count + float(c)
            out[f"eval_loss_{name}"] = total / max(count, 1.0)
        return out

    def params(self) -> Any:
        """The params the model runs with now (LoRA applied unmerged)."""
        return model_params(self.state.trainable, self.state.frozen)

    def save(self, path: Path, step: int, iterator: Any) -> None:
        with TrainCheckpointer(path, max_to_keep=2) as ckpt:
            ckpt.save(step, self.state, iterator)

    def restore(self, path: Path, iterator: Any = None) -> int:
        """The latest checkpoint into this trainer and ``iterator`` (None: the model and
        optimiser only); returns its step."""
        with TrainCheckpointer(path, max_to_keep=2) as ckpt:
            self.state = ckpt.restore(self.state, iterator)
        return int(np.asarray(self.state.step))

    def export(self, path: Path) -> None:
        """The trained model (LoRA merged) as a folder the server loads (``--model-path``)."""
        export_for_serving(path, self.cfg, self.state, self.model.tokenizer)
