"""The training data pipeline, in grain: JSONL records -> shuffled, sharded, packed batches.

    lines of the file (random access, :class:`JsonlSource`)
      -> shuffle (seeded; a new order every epoch) -> repeat
      -> shard: this data-parallel process takes every ``shard_count``-th record
      -> tokenise (:class:`~akv_jax.train.sources.Tokenise`)
      -> pack: windows of ``window`` trajectories grouped first-fit into examples of at most
         ``max_tokens`` tokens (the packer's own grouping), each group packed into one
         fixed-size example with no attention across trajectories (``akv_jax.train.pack``)
      -> batch (``batch_size`` examples stacked)

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grain

from akv_jax.train.example import TrainTrajectory
from akv_jax.train.sources import DataError, JsonlSource, Tokenise

# groups(lengths, max_tokens) -> lists of indices into lengths, each list one example
GroupFn = Callable[[Sequence[int], int], list[list[int]]]
# pack(trajectories) -> one fixed-size example (a pytree of numpy arrays)
PackFn = Callable[[Sequence[TrainTrajectory]], Any]


@dataclasses.dataclass(frozen=True)
class LoadRecord:
    """Item ``(line, text)`` -> trajectory, refusing one that fits no example (picklable)."""

    tokenise: Tokenise
    where: str
    max_tokens: int

    def __call__(self, item: tuple[int, str]) -> TrainTrajectory:
        traj = self.tokenise(item, self.where)
        if traj.num_tokens > self.max_tokens:
            raise DataError(
                f"{self.where}:{item[0]}",
                "messages",
                f"{traj.num_tokens} tokens do not fit an example of max_tokens={self.max_tokens}",
            )
        return traj


def trajectory_dataset(
    path: str | Path,
    tokenise: Tokenise,
    max_tokens: int,
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
    return ds.map(LoadRecord(tokenise, str(src.path), max_tokens))


class PackIterDataset(grain.IterDataset):
    """Trajectories -> packed examples, first-fit within windows of ``window`` trajectories."""

    def __init__(
        self, parent: grain.IterDataset, window: int, max_tokens: int, group: GroupFn, pack: PackFn
    ):
        super().__init__(parent)
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window, self.max_tokens, self.group, self.pack = window, max_tokens, group, pack

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
        groups = self._spec.group([t.num_tokens for t in items], self._spec.max_tokens)
        if sorted(i for g in groups for i in g) != list(range(len(items))):
            raise RuntimeError("the packer's grouping must use every trajectory once")
        self._groups = [[items[i] for i in g] for g in groups]
        self._done = 0

    def __next__(self) -> Any:
        if self._done >= len(self._groups):
            self._fill()
        group = self._groups[self._done]
        self._done += 1
        return self._spec.pack(group)

    def get_state(self) -> dict[str, Any]:
        return {"window_start": copy.deepcopy(self._start), "packs_done": self._done}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(copy.deepcopy(state["window_start"]))
        self._groups, self._done = [], 0
        done = int(state["packs_done"])
        if done:
            self._fill()
            self._done = done


def default_packer(max_tokens: int, **pack_kwargs: Any) -> tuple[GroupFn, PackFn]:
    """The core packer's first-fit grouping and fixed-size pack at ``max_tokens``."""
    from akv_jax.train import pack as core

    def pack(trajs: Sequence[TrainTrajectory]) -> Any:
        return core.pack(trajs, max_tokens=max_tokens, **pack_kwargs)

    return core.first_fit, pack


def packed_batches(
    trajectories: grain.MapDataset,
    *,
    max_tokens: int,
    batch_size: int,
    window: int = 64,
    group: GroupFn | None = None,
    pack: PackFn | None = None,
    drop_remainder: bool = True,
) -> grain.IterDataset:
    """``trajectories`` packed into examples of ``max_tokens`` and stacked ``batch_size`` at a
    time (``group``/``pack`` default to :func:`default_packer`)."""
    if group is None or pack is None:
        dg, dp = default_packer(max_tokens)
        group, pack = group or dg, pack or dp
    packs = PackIterDataset(trajectories.to_iter_dataset(), window, max_tokens, group, pack)
    return packs.batch(batch_size, drop_remainder=drop_remainder)


def train_batches(
    path: str | Path,
    tokenise: Tokenise,
    *,
    max_tokens: int,
    batch_size: int,
    seed: int = 0,
    window: int = 64,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: int | None = None,
    group: GroupFn | None = None,
    pack: PackFn | None = None,
) -> grain.IterDataset:
    """The whole training pipeline over ``path``; ``iter()`` of it is the checkpointable
    iterator (``get_state`` / ``set_state``)."""
    ds = trajectory_dataset(
        path,
        tokenise,
        max_tokens,
        seed=seed,
        num_epochs=num_epochs,
        shard_index=shard_index,
        shard_count=shard_count,
    )
    return packed_batches(
        ds, max_tokens=max_tokens, batch_size=batch_size, window=window, group=group, pack=pack
    )
