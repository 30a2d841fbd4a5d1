"""The command line's training state: model, packer, optimiser, one jitted step, evaluation
under both views, checkpoints and the export for serving. Glue over the core modules
(:mod:`akv_jax.train.pack`, :mod:`akv_jax.train.loss`) and the libraries (optax, orbax,
grain's orbax handler); :mod:`akv_jax.train.cli` drives it."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from akv_jax.train import loss as core_loss
from akv_jax.train.data import CorePacker
from akv_jax.train.example import TrainTrajectory
from akv_jax.train.pack import PackShape
from converters.loading import LoadedModel


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """AdamW on a warmup-cosine schedule, after global-norm clipping; ``--accum`` micro-steps
    per update (optax.MultiSteps)."""
    updates = -(-args.steps // args.accum)
    warmup = args.warmup if args.warmup is not None else max(1, updates // 10)
    sched = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(warmup, updates), max(updates, warmup + 1), end_value=args.lr * 0.1
    )
    opt = optax.chain(
        optax.clip_by_global_norm(args.clip),
        optax.adamw(sched, weight_decay=args.weight_decay),
    )
    return optax.MultiSteps(opt, args.accum) if args.accum > 1 else opt


class Trainer:
    def __init__(self, model: LoadedModel, args: argparse.Namespace):
        self.model, self.cfg = model, model.cfg
        self.shape = PackShape(
            max_tokens=args.max_tokens,
            max_segments=args.max_segments,
            max_trajectories=args.max_trajectories,
            max_versions=args.max_versions,
        )
        self.packer = CorePacker(self.shape)
        self.params = model.params
        self.optimizer = make_optimizer(args)
        self.opt_state = self.optimizer.init(self.params)
        cfg, shape, optimizer = self.cfg, self.shape, self.optimizer

        def mean_loss(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
            total, count = core_loss.loss_sums(params, cfg, batch, shape)
            return total / jnp.maximum(count, 1.0), count

        def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
            (value, _), grads = jax.value_and_grad(mean_loss, has_aux=True)(params, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        self._step = jax.jit(step, donate_argnums=(0, 1))
        self._sums = jax.jit(lambda p, b: core_loss.loss_sums(p, cfg, b, shape))

    def step(self, batch: Any) -> tuple[float, int]:
        """One optimiser step on ``batch``: (its mean target loss, its real tokens)."""
        self.params, self.opt_state, value = self._step(self.params, self.opt_state, batch)
        return float(value), int((np.asarray(batch.row_trajectory) >= 0).sum())

    def evaluate(self, views: Mapping[str, Sequence[TrainTrajectory]]) -> dict[str, float]:
        """``eval_loss_<view>``: mean target loss over each view's trajectories (packed
        first-fit, one pack at a time)."""
        out = {}
        for name, trajs in views.items():
            total = count = 0.0
            for group in self.packer.group(trajs):
                ex = self.packer.batch([self.packer.pack([trajs[i] for i in group])])
                t, c = self._sums(self.params, ex)
                total, count = total + float(t), count + float(c)
            out[f"eval_loss_{name}"] = total / max(count, 1.0)
        return out

    # ---- checkpoints

    def _manager(self, path: Path) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            path.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2)
        )

    def save(self, path: Path, step: int, iterator: Any) -> None:
        import grain

        with self._manager(path) as mgr:
            mgr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"params": self.params, "opt": self.opt_state}),
                    data=grain.checkpoint.CheckpointSave(iterator),
                ),
            )
            mgr.wait_until_finished()

    def restore(self, path: Path, iterator: Any = None) -> int:
        """Restore the latest checkpoint into this trainer and ``iterator`` (None: the model
        and optimiser only); returns its step."""
        import grain

        with self._manager(path) as mgr:
            step = mgr.latest_step()
            target = {"params": self.params, "opt": self.opt_state}
            items = {
                "state": ocp.args.StandardRestore(
                    jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
                )
            }
            if iterator is not None:
                items["data"] = grain.checkpoint.CheckpointRestore(iterator)
            got = mgr.restore(step, args=ocp.args.Composite(**items))
        self.params, self.opt_state = got.state["params"], got.state["opt"]
        return int(step)

    def export(self, path: Path) -> None:
        """The trained model as a converted folder the server loads (``--model-path``)."""
        from akv_jax.model.checkpoint import save_checkpoint

        path.mkdir(parents=True, exist_ok=True)
        dtype = str(jnp.dtype(self.params.embed.dtype))
        save_checkpoint(path, self.cfg, self.params, dtype, origin="akv_jax.train")
        if self.model.tokenizer is not None:
            self.model.tokenizer.save(path)
