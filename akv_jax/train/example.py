"""One training trajectory: token segments, the op history applied to them, and which tokens
are predicted. The data pipeline produces these; the packer and the loss consume them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from akv_jax.cache.ops import OpHistory


@dataclasses.dataclass(frozen=True)
class TrainTrajectory:
    """``segments[s]`` are segment s's token ids (one chat message each, rendered by the chat
    template); ``history`` the ops over them (the request's ``cache`` field, parsed);
    ``loss_mask[s][i]`` is True where token i of segment s is a prediction target (predicted
    from the tokens before it, under the view segment s had when it was appended)."""

    segments: Sequence[Sequence[int]]
    history: OpHistory
    loss_mask: Sequence[np.ndarray]

    def __post_init__(self) -> None:
        if len(self.segments) != self.history.num_segments:
            raise ValueError(
                f"history covers {self.history.num_segments} segments, got {len(self.segments)}"
            )
        for s, (seg, mask) in enumerate(zip(self.segments, self.loss_mask, strict=True)):
            if len(seg) != len(mask):
                raise ValueError(f"loss_mask[{s}] has {len(mask)} entries for {len(seg)} tokens")

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)
