"""The training data pipeline, in grain: JSONL records -> shuffled, sharded, packed batches.

    lines of the file (random access, :class:`JsonlSource`)
      -> shuffle (seeded; a new order every epoch) -> repeat
      -> shard: this data-parallel process takes every ``shard_count``-th record
      -> tokenise (:class:`~akv_jax.train.sources.Tokenise`)
      -> pack: windows of ``window`` trajectories grouped into examples by the packer
         (the core's first fit within a pack's budgets: tokens, segments, pages), each group
         packed into one fixed-size example with no attention across trajectories
         (:class:`CorePacker`: :mod:`akv_jax.train.pack`)
      -> batch (``batch_size`` examples stacked by the packer)

Everything before packing is a ``grain.MapDataset`` (random access: record i of epoch e is a
pure function of the seed), so the iterator's state is a few integers. The packing step is
ours (:class:`PackIterDataset`): its state is the parent's state at the start of the current
window plus the number of that window's packs already yielded; restoring re-reads the window
and re-groups it (deterministically), so a restored iterator yields exactly the batches the
original would have (``get_state``/``set_state``; the checkpoint stores that state).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import grain

from akv_jax.train.example import TrainTrajectory
from akv_jax.train.sources import DataError, JsonlSource, Tokenise


class Packer(Protocol):
    """How trajectories become fixed-size examples (the core's: :class:`CorePacker`)."""

    def over(self, traj: TrainTrajectory) -> str | None:
        """Why ``traj`` fits no example on its own (None if it fits)."""

    def group(self, trajs: Sequence[TrainTrajectory]) -> list[list[int]]:
        """Indices of ``trajs`` per example, each index once (deterministic)."""

    def pack(self, trajs: Sequence[TrainTrajectory]) -> Any:
        """One example holding ``trajs``, with no attention across them."""

    def batch(self, examples: Sequence[Any]) -> Any:
        """Examples stacked along a new leading axis."""


@dataclasses.dataclass(frozen=True)
class CorePacker:
    """:mod:`akv_jax.train.pack` at one :class:`~akv_jax.train.pack.PackShape`."""

    shape: Any  # PackShape

    def over(self, traj: TrainTrajectory) -> str | None:
        from akv_jax.train import pack

        return pack.usage(traj, self.shape.page_size).over(self.shape)

    def group(self, trajs: Sequence[TrainTrajectory]) -> list[list[int]]:
        from akv_jax.train import pack

        return pack.first_fit(trajs, self.shape)

    def pack(self, trajs: Sequence[TrainTrajectory]) -> Any:
        from akv_jax.train import pack

        return pack.pack(trajs, self.shape)

    def batch(self, examples: Sequence[Any]) -> Any:
        from akv_jax.train import pack

        return pack.stack(examples)


@dataclasses.dataclass(frozen=True)
class LoadRecord:
    """Item ``(line, text)`` -> trajectory, refusing one that fits no example (picklable)."""

    tokenise: Tokenise
    where: str
    packer: Packer

    def __call__(self, item: tuple[int, str]) -> TrainTrajectory:
        traj = self.tokenise(item, self.where)
        if (why := self.packer.over(traj)) is not None:
            raise DataError(
                f"{self.where}:{item[0]}", "messages", f"too large for one example ({why})"
            )
        return traj


def read_all(path: str | Path, tokenise: Tokenise, packer: Packer) -> list[TrainTrajectory]:
    """Every record of ``path``, in order, checked as the pipeline checks them (to validate a
    file up front, or to hold a small evaluation set)."""
    src = JsonlSource(path)
    load = LoadRecord(tokenise, str(src.path), packer)
    return [load(src[i]) for i in range(len(src))]


def trajectory_dataset(
    path: str | Path,
    tokenise: Tokenise,
    packer: Packer,
    *,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
) -> grain.MapDataset:
    """The records of ``path`` as trajectories: shuffled per epoch, repeated ``num_epochs``
    times (None: forever) and sharded (this shard's records: every ``shard_count``-th from
    ``shard_index``, so shards are disjoint and together cover every epoch)."""
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} outside [0, {shard_count})")
    src = JsonlSource(path)
    ds = grain.MapDataset.source(src)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    ds = ds[shard_index::shard_count]
    return ds.map(LoadRecord(tokenise, str(src.path), packer))


class PackIterDataset(grain.IterDataset):
    """Trajectories -> packed examples, first-fit within windows of ``window`` trajectories."""

    def __init__(self, parent: grain.IterDataset, window: int, packer: Packer):
        super().__init__(parent)
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window, self.packer = window, packer

    def __iter__(self) -> _PackIterator:
        return _PackIterator(self._parent.__iter__(), self)


class _PackIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, spec: PackIterDataset):
        super().__init__(parent)
        self._spec = spec
        self._start = copy.deepcopy(parent.get_state())  # parent state at the window's start
        self._groups: list[list[TrainTrajectory]] = []
        self._done = 0

    def _fill(self) -> None:
        self._start = copy.deepcopy(self._parent.get_state())
        items: list[TrainTrajectory] = []
        for _ in range(self._spec.window):
            try:
                items.append(next(self._parent))
            except StopIteration:
                break
        if not items:
            raise StopIteration
        groups = self._spec.packer.group(items)
        if sorted(i for g in groups for i in g) != list(range(len(items))):
            raise RuntimeError("the packer's grouping must use every trajectory once")
        self._groups = [[items[i] for i in g] for g in groups]
        self._done = 0

    def __next__(self) -> Any:
        if self._done >= len(self._groups):
            self._fill()
        group = self._groups[self._done]
        self._done += 1
        return self._spec.packer.pack(group)

    def get_state(self) -> dict[str, Any]:
        return {"window_start": copy.deepcopy(self._start), "packs_done": self._done}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(copy.deepcopy(state["window_start"]))
        self._groups, self._done = [], 0
        done = int(state["packs_done"])
        if done:
            self._fill()
            self._done = done


def packed_batches(
    trajectories: grain.MapDataset,
    packer: Packer,
    *,
    batch_size: int,
    window: int = 64,
    drop_remainder: bool = True,
) -> grain.IterDataset:
    """``trajectories`` packed by ``packer`` and stacked ``batch_size`` examples at a time."""
    packs = PackIterDataset(trajectories.to_iter_dataset(), window, packer)
    return packs.batch(batch_size, drop_remainder=drop_remainder, batch_fn=packer.batch)


def train_batches(
    path: str | Path,
    tokenise: Tokenise,
    packer: Packer,
    *,
    batch_size: int,
    seed: int = 0,
    window: int = 64,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: int | None = None,
) -> grain.IterDataset:
    """The whole training pipeline over ``path``; ``iter()`` of it is the checkpointable
    iterator (``get_state`` / ``set_state``)."""
    ds = trajectory_dataset(
        path,
        tokenise,
        packer,
        seed=seed,
        num_epochs=num_epochs,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    return packed_batches(ds, packer, batch_size=batch_size, window=window)
