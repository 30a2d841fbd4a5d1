"""Training checkpoints (orbax) and the export the server loads.

A training checkpoint folder is an orbax ``CheckpointManager`` directory, one numbered step
folder per save, each holding

* ``state``: the :class:`~akv_jax.train.step.TrainState` (step, trainable params or LoRA
  adapters, optimiser state; the frozen base of a LoRA run is *not* saved: it is the model
  the run started from), orbax's standard pytree format;
* ``data`` (optional): the grain iterator's own state (grain's orbax handler,
  ``grain.checkpoint.CheckpointSave``), so a resumed run reads the very next batch.

Restoring both into freshly built objects continues the run exactly: the same batches, the
same optimiser state, so the same losses as a run that was never stopped.

:func:`export_for_serving` writes the trained model (LoRA merged) as a converted checkpoint
(:mod:`akv_jax.model.checkpoint`), which ``python -m akv_jax.serving.main --model-path``
loads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from akv_jax.model.checkpoint import save_checkpoint
from akv_jax.model.config import ModelConfig
from akv_jax.model.params import Params
from akv_jax.train.lora import LoraParams, merge
from akv_jax.train.step import TrainState


def _saved_part(state: TrainState) -> TrainState:
    return dataclasses.replace(state, frozen=None)


class TrainCheckpointer:
    """Save and restore (state, data iterator) pairs under ``directory``; keeps the newest
    ``max_to_keep`` steps."""

    def __init__(self, directory: str | Path, max_to_keep: int | None = 3):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def save(self, step: int, state: TrainState, data_iter: Any = None) -> None:
        """Save ``state`` (and ``data_iter``'s position) as ``step``; blocks until written."""
        items = {"state": ocp.args.StandardSave(_saved_part(state))}
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iter)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(
        self, like: TrainState, data_iter: Any = None, step: int | None = None
    ) -> TrainState:
        """The state saved at ``step`` (default: the latest), shaped and placed like ``like``
        (a freshly initialised state: same model, optimiser, shardings; its ``frozen`` base
        is kept). ``data_iter`` (a fresh grain iterator of the same pipeline) is moved to the
        saved position in place."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, _saved_part(like))
        items = {"state": ocp.args.StandardRestore(target)}
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        # orbax hands back arrays committed to their devices; where ``like`` is uncommitted
        # (a single-device run), so is the result: a jitted step compiled for the fresh
        # state then runs the restored one without compiling again
        state = jax.tree.map(
            lambda x, ref: x if ref.committed else jax.device_put(np.asarray(x)),
            out["state"],
            _saved_part(like),
        )
        return dataclasses.replace(state, frozen=like.frozen)

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serving_params(state: TrainState) -> Params:
    """The params to serve: the trained params, or the base with the adapters merged."""
    if isinstance(state.trainable, LoraParams):
        if state.frozen is None:
            raise ValueError("a LoRA state needs its frozen base params to be exported")
        return merge(state.frozen, state.trainable)
    return state.trainable


def export_for_serving(
    out_dir: str | Path,
    cfg: ModelConfig,
    state: TrainState,
    tokenizer: Any = None,
    origin: str = "akv_jax.train",
) -> Path:
    """Write the trained model (LoRA merged) as a converted checkpoint folder: ``config.json``
    and orbax params, plus the tokenizer files when ``tokenizer`` is given (a
    :class:`~akv_jax.model.tokenizer.ChatTokenizer`). Refuses a non-empty ``out_dir``."""
    out = Path(out_dir).absolute()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"export folder {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    params = serving_params(state)
    dtype = str(jax.tree.leaves(params)[0].dtype)
    save_checkpoint(out, cfg, jax.device_get(params), dtype=dtype, origin=origin)
    if tokenizer is not None:
        tokenizer.save(out)
    return out
