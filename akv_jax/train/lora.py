"""LoRA adapters on the attention and MLP projections, as a pytree of their own.

:class:`LoraParams` holds, for each adapted projection ``W`` (stacked over layers like the
params), a down matrix ``a`` [L, in..., r] and an up matrix ``b`` [L, r, out...]; the
adapted weight is ``W + scale * a @ b`` with ``scale = alpha / r``. Two ways to apply it:

* :func:`adapt`: for training. The params tree with each adapted projection replaced by an
  :class:`akv_jax.kernels.projection.Adapted`; the forward then computes
  ``x W + scale (x a) b``, never forming the full-size update (the base weights stay frozen
  inputs; only ``a`` and ``b`` get gradients);
* :func:`merge`: for serving. Plain params with ``W + scale * a @ b`` folded in, loadable
  and servable like any checkpoint.

MoE expert weights are not adapted (their projections are ragged grouped matmuls); on a MoE
model the attention projections (and the dense MLP layers, if any) are.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.kernels.projection import Adapted
from akv_jax.model.params import Params

# Adaptable projections and how many leading (non-layer) axes of each are its input.
TARGETS: dict[str, int] = {
    "wq": 1,
    "wk": 1,
    "wv": 1,
    "wo": 2,
    "w_gate": 1,
    "w_up": 1,
    "w_down": 1,
}


@dataclasses.dataclass(frozen=True)
class LoraPair:
    a: jax.Array  # [L, in..., r]
    b: jax.Array  # [L, r, out...]


jax.tree_util.register_dataclass(LoraPair, data_fields=["a", "b"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class LoraParams:
    """One :class:`LoraPair` per adapted projection (None: not adapted); ``scale`` (alpha / r)
    is static."""

    wq: LoraPair | None = None
    wk: LoraPair | None = None
    wv: LoraPair | None = None
    wo: LoraPair | None = None
    w_gate: LoraPair | None = None
    w_up: LoraPair | None = None
    w_down: LoraPair | None = None
    scale: float = 1.0

    @property
    def rank(self) -> int:
        return next(p.a.shape[-1] for p in self.pairs().values())

    def pairs(self) -> dict[str, LoraPair]:
        return {t: getattr(self, t) for t in TARGETS if getattr(self, t) is not None}


jax.tree_util.register_dataclass(LoraParams, data_fields=list(TARGETS), meta_fields=["scale"])


def init_lora(
    params: Params,
    *,
    rank: int,
    alpha: float | None = None,
    targets: tuple[str, ...] = tuple(TARGETS),
    seed: int = 0,
    b_std: float = 0.0,
) -> LoraParams:
    """Adapters for ``targets`` of ``params``: ``a`` ~ N(0, 1/in) and ``b`` = 0 (so the
    adapted model starts as the base model), or ``b`` ~ N(0, b_std) when ``b_std`` > 0 (tests).
    ``alpha`` defaults to ``rank`` (scale 1). float32, drawn with numpy from ``seed``."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise ValueError(f"unknown LoRA target {sorted(unknown)[0]!r}; choose from {list(TARGETS)}")
    rng = np.random.default_rng(seed)
    out = {}
    for name in targets:
        w = getattr(params.layers, name)
        if w is None:  # e.g. the dense MLP of an all-MoE model
            continue
        n_in = TARGETS[name]
        lead, ins, outs = w.shape[:1], w.shape[1 : 1 + n_in], w.shape[1 + n_in :]
        fan_in = int(np.prod(ins))
        a = rng.standard_normal((*lead, *ins, rank), dtype=np.float32) / np.sqrt(fan_in)
        b = rng.standard_normal((*lead, rank, *outs), dtype=np.float32) * b_std
        out[name] = LoraPair(jnp.asarray(a), jnp.asarray(b))
    if not out:
        raise ValueError("none of the LoRA targets exists in this model")
    return LoraParams(**out, scale=float(alpha if alpha is not None else rank) / rank)


def adapt(params: Params, lora: LoraParams) -> Params:
    """``params`` with each adapted projection an :class:`Adapted` (applied unmerged)."""
    layers = {
        name: Adapted(getattr(params.layers, name), pair.a, pair.b, lora.scale)
        for name, pair in lora.pairs().items()
    }
    return dataclasses.replace(params, layers=dataclasses.replace(params.layers, **layers))


def delta(pair: LoraPair, scale: float) -> jax.Array:
    """The full-size update ``scale * a @ b`` of one projection [L, in..., out...]."""
    return scale * jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1))(pair.a, pair.b)


def merge(params: Params, lora: LoraParams) -> Params:
    """Plain params with every adapter folded in: ``W + scale * a @ b`` (for serving)."""
    layers: dict[str, jax.Array] = {}
    for name, pair in lora.pairs().items():
        w = getattr(params.layers, name)
        layers[name] = (w.astype(jnp.float32) + delta(pair, lora.scale)).astype(w.dtype)
    return dataclasses.replace(params, layers=dataclasses.replace(params.layers, **layers))
