"""The optimiser: optax AdamW on a warmup-cosine schedule, global-norm clipping, gradient
accumulation (``optax.MultiSteps``). All optax; this module only fixes the recipe."""

from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """``lr`` peak learning rate, reached linearly from 0 over ``warmup_steps`` optimiser
    updates, then cosine-decayed to ``lr * end_lr_ratio`` at ``total_steps``. ``clip_norm``:
    global gradient norm limit (None: no clipping). ``accum_steps`` micro-batches are
    averaged into each update. Weight decay applies to matrices only (not norms, biases)."""

    lr: float = 1e-4
    warmup_steps: int = 10
    total_steps: int = 1000
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    accum_steps: int = 1

    def __post_init__(self) -> None:
        if self.accum_steps < 1:
            raise ValueError(f"accum_steps must be >= 1, got {self.accum_steps}")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError("total_steps must be >= 1 and warmup_steps >= 0")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def schedule(cfg: OptimConfig) -> optax.Schedule:
    """The learning rate of each optimiser update (not micro-step)."""
    warmup = min(cfg.warmup_steps, cfg.total_steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1),
        end_value=cfg.lr * cfg.end_lr_ratio,
    )


def _decay_mask(params):
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip -> AdamW(schedule), wrapped in MultiSteps when accumulating."""
    parts = []
    if cfg.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    parts.append(
        optax.adamw(
            schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=_decay_mask,
        )
    )
    tx = optax.chain(*parts)
    if cfg.accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=cfg.accum_steps)
    return tx
