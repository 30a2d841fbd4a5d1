"""A step's greedy constrained rows, masked on the device (:func:`masked_greedy`).

The grammar masks are ready while the forward still runs; the masked argmax is dispatched
right behind it, and its few numbers are read only for the rows whose unmasked greedy token
the grammar forbids. Row counts are padded to few shapes (each is a compile)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from akv_jax.pallas.metadata import bucket
from akv_jax.serving.device_group import masked_greedy


class MaskedGreedy:
    def __init__(self) -> None:
        self._index: dict[str, int] = {}
        self._rows: list[int] = []
        self._bits: list[np.ndarray] = []
        self._out: tuple[jax.Array, jax.Array] | None = None
        self._host: tuple[np.ndarray, np.ndarray] | None = None

    def add(self, rid: str, row: int, bits: np.ndarray) -> None:
        """Request ``rid``'s logits row ``row`` under its grammar's packed mask ``bits``."""
        self._index[rid] = len(self._rows)
        self._rows.append(row)
        self._bits.append(np.array(bits, np.int32))

    def dispatch(self, logits: jax.Array) -> None:
        if not self._rows:
            return
        k = bucket(len(self._rows), 8)
        rows = np.full(k, self._rows[0], np.int32)
        rows[: len(self._rows)] = self._rows
        bits = np.repeat(self._bits[:1], k, axis=0)
        bits[: len(self._bits)] = self._bits
        self._out = masked_greedy(logits, jnp.asarray(rows), jnp.asarray(bits))

    def result(self, rid: str) -> tuple[int, float] | None:
        """``rid``'s masked greedy token and its log-probability (None: not added)."""
        i = self._index.get(rid)
        if i is None or self._out is None:
            return None
        if self._host is None:
            self._host = (np.asarray(self._out[0]), np.asarray(self._out[1]))
        return int(self._host[0][i]), float(self._host[1][i])
