"""Pack several trajectories into one fixed-size training example.

Each trajectory is planned exactly as a one-pass restore plans it
(:func:`akv_jax.cache.restore_plan.plan`): its tokens, the position each was computed at,
the slots every position version of its keys is written to, and one query segment per
message over the pages of the version it saw. Packing lays the trajectories side by side:
their tokens are concatenated into one query array, and each gets its own run of KV pages
(its plan's pages shifted by a base page), so every segment's view holds its own
trajectory's keys only. No attention crosses trajectories by construction: a view is a list
of pages, and no page is shared.

Every dimension is static (:class:`PackShape`), so every pack of one shape runs the same
compiled training step.

**Target convention.** Row ``r`` of the pack is token ``j`` of some trajectory; its logits
(computed under the view of the segment holding ``j``, as the op-by-op run computes them when
that segment is appended) predict token ``j + 1`` of the same trajectory. So
``targets[r] = token j + 1`` and ``weights[r] = loss_mask`` of token ``j + 1``: a
trajectory's first token is never a target, and the first token of segment ``s`` is
predicted from the last token of segment ``s - 1`` under segment ``s - 1``'s view (the ops
at boundary ``s - 1`` come after that prediction, exactly as at inference). The last row of a
trajectory and padding rows have weight 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from akv_jax.cache.restore_plan import RestorePlan, plan
from akv_jax.pallas.metadata import SegmentBatch, SegmentSpec, build_segment_batch
from akv_jax.train.example import TrainTrajectory


@dataclasses.dataclass(frozen=True)
class PackShape:
    """The static sizes of a pack (every array's shape follows from these).

    ``max_tokens`` query rows (a multiple of ``block_q``), at most ``max_segments`` messages
    and ``max_trajectories`` trajectories in all, at most ``max_versions`` position versions
    per trajectory (repositions + 1), and a KV pool of ``pool_pages`` pages (default: room
    for ``max_versions`` versions of every trajectory at the token budget).
    """

    max_tokens: int
    page_size: int = 16
    block_q: int = 16
    max_segments: int = 64
    max_trajectories: int = 8
    max_versions: int = 4
    pool_pages: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_tokens",
            "page_size",
            "block_q",
            "max_segments",
            "max_trajectories",
            "max_versions",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"PackShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens % self.block_q:
            raise ValueError(
                f"PackShape.max_tokens={self.max_tokens} must be a multiple of "
                f"block_q={self.block_q}"
            )
        if self.pool_pages is not None and self.pool_pages < self.view_pages:
            raise ValueError(f"PackShape.pool_pages must be >= {self.view_pages}")

    @property
    def view_pages(self) -> int:
        """Pages of the longest view: a trajectory never holds more than max_tokens keys."""
        return -(-self.max_tokens // self.page_size)

    @property
    def num_pages(self) -> int:
        """KV pool pages. A trajectory of T tokens uses ceil(T / page_size) pages per
        version; over all trajectories that is at most view_pages + max_trajectories."""
        if self.pool_pages is not None:
            return self.pool_pages
        return self.max_versions * (self.view_pages + self.max_trajectories)

    @property
    def num_blocks(self) -> int:
        """Query blocks: a segment wastes at most one partial block."""
        return self.max_tokens // self.block_q + self.max_segments


@dataclasses.dataclass(frozen=True)
class Usage:
    """What a trajectory (or a set of them) takes of a pack's budgets."""

    tokens: int = 0
    segments: int = 0
    trajectories: int = 0
    versions: int = 0  # the largest per trajectory
    pages: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.tokens + other.tokens,
            self.segments + other.segments,
            self.trajectories + other.trajectories,
            max(self.versions, other.versions),
            self.pages + other.pages,
        )

    def over(self, shape: PackShape) -> str | None:
        """The first budget this usage exceeds, as ``"field: used > limit"``; None if it fits."""
        limits = (
            ("max_tokens", self.tokens, shape.max_tokens),
            ("max_segments", self.segments, shape.max_segments),
            ("max_trajectories", self.trajectories, shape.max_trajectories),
            ("max_versions", self.versions, shape.max_versions),
            ("pool_pages", self.pages, shape.num_pages),
        )
        for name, used, limit in limits:
            if used > limit:
                return f"{name}: {used} > {limit}"
        return None


def usage(traj: TrainTrajectory, page_size: int) -> Usage:
    versions = len(traj.history.repos) + 1
    return Usage(
        tokens=traj.num_tokens,
        segments=len(traj.segments),
        trajectories=1,
        versions=versions,
        pages=versions * -(-traj.num_tokens // page_size),
    )


def fits(trajectories: Sequence[TrainTrajectory], shape: PackShape) -> bool:
    """Whether ``trajectories`` pack together into one example of ``shape``."""
    total = sum((usage(t, shape.page_size) for t in trajectories), Usage())
    return total.over(shape) is None


def first_fit(trajectories: Sequence[TrainTrajectory], shape: PackShape) -> list[list[int]]:
    """Greedy first-fit, in order: each trajectory goes into the first open pack it fits in.
    Returns the packs as lists of indices into ``trajectories`` (deterministic). A
    trajectory too large for an empty pack raises ValueError naming the budget."""
    bins: list[list[int]] = []
    used: list[Usage] = []
    for i, t in enumerate(trajectories):
        u = usage(t, shape.page_size)
        if (why := u.over(shape)) is not None:
            raise ValueError(f"trajectory {i} does not fit in an empty pack ({why})")
        for b in range(len(bins)):
            if (used[b] + u).over(shape) is None:
                bins[b].append(i)
                used[b] = used[b] + u
                break
        else:
            bins.append([i])
            used.append(u)
    return bins


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedExample:
    """One pack: numpy arrays whose shapes depend only on its :class:`PackShape` (T =
    max_tokens, W = max_versions, NB = num_blocks, S = max_segments, MP = view_pages,
    ps = page_size). A jax pytree, so a stack of them (leading batch axis) goes straight
    into a jitted step."""

    tokens: np.ndarray  # [T] int32 token of each query row (0 for padding)
    q_positions: np.ndarray  # [T] int32 RoPE position each row is computed at
    write_slots: np.ndarray  # [W, T] int32 pool slot of each version's key (out of pool: none)
    write_positions: np.ndarray  # [W, T] int32 position of that version of the key
    block_seg: np.ndarray  # [NB] int32 the segment-batch metadata (SegmentBatch's fields)
    block_q_start: np.ndarray  # [NB]
    block_q_len: np.ndarray  # [NB]
    block_kv_pos: np.ndarray  # [NB]
    page_table: np.ndarray  # [S, MP]
    kv_len: np.ndarray  # [S]
    kv_visible: np.ndarray  # [S, MP * ps] bool
    page_visible: np.ndarray  # [S, MP] bool
    targets: np.ndarray  # [T] int32 next token of the row's trajectory (0 where none)
    weights: np.ndarray  # [T] float32 loss weight of each row's target (0: not a target)
    row_trajectory: np.ndarray  # [T] int32 which trajectory of the pack a row is (-1: padding)

    def segment_batch(self) -> SegmentBatch:
        return SegmentBatch(
            block_seg=self.block_seg,
            block_q_start=self.block_q_start,
            block_q_len=self.block_q_len,
            block_kv_pos=self.block_kv_pos,
            page_table=self.page_table,
            kv_len=self.kv_len,
            kv_visible=self.kv_visible,
            page_visible=self.page_visible,
        )

    def to_dict(self) -> dict[str, np.ndarray]:
        """Plain ``name -> array`` (what a grain pipeline batches)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @staticmethod
    def from_dict(d: dict[str, np.ndarray]) -> PackedExample:
        return PackedExample(**{f.name: d[f.name] for f in dataclasses.fields(PackedExample)})


def _plan(traj: TrainTrajectory, shape: PackShape) -> RestorePlan:
    T = traj.num_tokens
    return plan(
        traj.segments,
        traj.history,
        max_pages=-(-T // shape.page_size),
        page_size=shape.page_size,
        block_q=shape.block_q,
        t_pad=-(-T // shape.block_q) * shape.block_q,
    )


def pack(trajectories: Sequence[TrainTrajectory], shape: PackShape) -> PackedExample:
    """Pack ``trajectories`` (in order) into one example of ``shape`` (see the module
    docstring for the target convention). Raises ValueError naming the budget they exceed
    (check with :func:`fits` / :func:`first_fit` first)."""
    if not trajectories:
        raise ValueError("pack needs at least one trajectory")
    for i, t in enumerate(trajectories):
        for s, seg in enumerate(t.segments):
            if len(seg) == 0:
                raise ValueError(f"trajectory {i}: segments[{s}] is empty")
    total = sum((usage(t, shape.page_size) for t in trajectories), Usage())
    if (why := total.over(shape)) is not None:
        raise ValueError(f"trajectories do not fit in one pack ({why})")
    T, W, ps = shape.max_tokens, shape.max_versions, shape.page_size
    sentinel = shape.num_pages * ps  # a slot outside the pool: "no write"
    tokens = np.zeros(T, np.int32)
    q_pos = np.zeros(T, np.int32)
    slots = np.full((W, T), sentinel, np.int32)
    wpos = np.zeros((W, T), np.int32)
    targets = np.zeros(T, np.int32)
    weights = np.zeros(T, np.float32)
    row_traj = np.full(T, -1, np.int32)
    specs: list[SegmentSpec] = []
    row, page = 0, 0
    for i, traj in enumerate(trajectories):
        p = _plan(traj, shape)
        n = traj.num_tokens
        rows = slice(row, row + n)
        tokens[rows] = p.tokens[:n]
        q_pos[rows] = p.q_positions[:n]
        own = p.write_slots[:, :n] < p.pool_pages * ps  # the plan's own "no write" is its size
        e = p.write_slots.shape[0]
        slots[:e, rows] = np.where(own, p.write_slots[:, :n] + page * ps, sentinel)
        wpos[:e, rows] = p.write_positions[:, :n]
        # row j predicts token j + 1 of the same trajectory (module docstring)
        mask = np.concatenate([np.asarray(m, np.float32) for m in traj.loss_mask])
        targets[row : row + n - 1] = p.tokens[1:n]
        weights[row : row + n - 1] = mask[1:]
        row_traj[rows] = i
        for spec in p.segments:
            specs.append(
                dataclasses.replace(
                    spec, q_start=spec.q_start + row, pages=[pg + page for pg in spec.pages]
                )
            )
        row += n
        page += p.pool_pages
    batch = build_segment_batch(
        specs,
        page_size=ps,
        block_q=shape.block_q,
        num_blocks=shape.num_blocks,
        num_segments=shape.max_segments,
        max_pages=shape.view_pages,
    )
    meta = {f.name: np.asarray(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
    return PackedExample(
        tokens=tokens,
        q_positions=q_pos,
        write_slots=slots,
        write_positions=wpos,
        targets=targets,
        weights=weights,
        row_trajectory=row_traj,
        **meta,
    )


def stack(examples: Sequence[PackedExample]) -> PackedExample:
    """A batch of packs: every array with a leading batch axis."""
    return jax.tree.map(lambda *xs: np.stack(xs), *examples)
