"""Runs planned work on the devices: packs passes into padded, bucketed arrays and
dispatches one jit-compiled forward per batch.

Few shapes, so that a few compiled programs serve every step: the token count in
half-octave (decode) or quarter-octave (prefill) steps; views in powers of two from 4,096
tokens. :meth:`Executor.run` pads with these and :meth:`Executor.warm_up_shapes` enumerates
them. The executor also owns the device groups (colocated, tensor-parallel, or disaggregated
prefill/decode) and hands pages between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from akv_jax.model.config import ModelConfig
from akv_jax.model.forward import KVWrites, make_model_attention
from akv_jax.model.params import Params, make_mesh
from akv_jax.model.rope import rope_table_for
from akv_jax.pallas.dispatch import layout_sets_bits, make_projection
from akv_jax.pallas.metadata import SegmentSpec, bucket, build_segment_batch
from akv_jax.serving.device_group import DeviceGroup, StepLogits, feed_pending, transfer_pages
from akv_jax.serving.host_tier import HostKV
from akv_jax.serving.work import NO_WRITE, Pass, RequestState

PREFILL_BLOCK_Q = 64  # query rows per attention block in prefill forwards
DECODE_BLOCK_Q = 1

Work = Sequence[tuple[RequestState | None, Pass]]


def token_bucket(n: int, block_q: int) -> int:
    """Padded row count of a forward: decode rows 1, 4, or in half-octave steps from 8;
    prefill rows in quarter-octave steps (at most 25% padded rows). A decode step streams the
    weights, so one row stays one (a matrix-vector product) and 2-4 rows share a 4-row shape;
    every shape is a compile (figures: ``docs/cpu-kernels.md``)."""
    if block_q == 1:
        return 1 if n == 1 else 4 if n <= 4 else bucket(n, 8, steps_per_octave=2)
    return bucket(n, max(block_q, 64), steps_per_octave=4)


def view_bucket(pages: int, page_size: int) -> int:
    return bucket(pages, max(1, 4096 // page_size))


def distinct_buckets(limit: int, pad) -> list[int]:
    """Every value ``pad(n)`` takes for ``n`` in ``1..limit``, ascending."""
    out: list[int] = []
    n = 1
    while n <= limit:
        out.append(pad(n))
        n = out[-1] + 1
    return out


def check_devices(tp: int, disaggregate: tuple[int, int] | None, available: int,
                  deterministic: bool = False) -> None:
    """Raise ValueError (one line, naming the flag) unless the device layout fits
    ``available`` devices (and ``--deterministic``, which runs one device per group: a
    sharded step's products are XLA's). The one statement of these rules: the command line
    checks with it before loading a model, the engine again when it builds its groups."""
    if tp < 1:
        raise ValueError(f"--tp {tp}: must be at least 1")
    if deterministic and (tp > 1 or disaggregate is not None):
        raise ValueError("--deterministic runs one device per group: not with --tp "
                         "or --disaggregate")
    if disaggregate is not None:
        n_p, n_d = disaggregate
        if tp > 1:
            raise ValueError("--tp and --disaggregate do not combine (each group is "
                             "tensor-parallel over its own devices)")
        if n_p < 1 or n_d < 1:
            raise ValueError(f"--disaggregate {n_p},{n_d}: each group needs a device")
        if n_p + n_d > available:
            raise ValueError(f"--disaggregate {n_p},{n_d}: needs {n_p + n_d} devices, "
                             f"{available} available")
    elif tp > available:
        raise ValueError(f"--tp {tp}: only {available} devices available")


def load_placement(tp: int, disaggregate: tuple[int, int] | None, devices: list | None = None):
    """Where ``converters.loading.load_model(placement=...)`` should put the params for the
    groups :class:`Executor` builds from these flags: None (one device); for ``--tp`` the
    group's own mesh, so that every param is loaded straight into its final sharding (the
    group's ``shard_params`` then moves nothing); ``"host"`` when disaggregated: numpy
    arrays, from which each group places its own copy shard by shard. No device ever holds
    a whole tensor-parallel param on the way."""
    if disaggregate is not None:
        return "host"
    if tp > 1:
        devices = list(devices if devices is not None else jax.devices())
        return make_mesh(tp, devices[:tp])
    return None


class Executor:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        *,
        num_pages: int,
        page_size: int,
        kv_dtype,
        attention_backend: str,
        tp: int = 1,
        disaggregate: tuple[int, int] | None = None,
        devices: list | None = None,
        host_pages: int = 0,
        deterministic: bool = False,
    ):
        """``tp``: tensor-parallel degree of the (colocated) device group.
        ``disaggregate=(P, D)``: prefill and restores on the first P devices, decode on the
        next D (each group tensor-parallel over its devices), KV pages handed between them.
        ``host_pages``: pages of the host tier (0: none).
        ``deterministic``: a request's bits independent of the batch on GPU and TPU too
        (fixed-tile products, attention without split-K: docs/design.md); on the CPU every
        mode is. One device per group (a sharded step's products are XLA's)."""
        self.cfg = cfg
        self.num_pages = num_pages
        self.page_size = page_size
        devices = list(devices if devices is not None else jax.devices())
        check_devices(tp, disaggregate, len(devices), deterministic)

        projection = make_projection(deterministic=deterministic)
        self.layout_sets_bits = layout_sets_bits(attention_backend, deterministic)

        def group(devs):
            return DeviceGroup(cfg, params, num_pages, page_size, kv_dtype, devs,
                               attention_backend=attention_backend, projection=projection)

        if disaggregate is not None:
            n_p, n_d = disaggregate
            self.prefill = group(devices[:n_p])
            self.decode = group(devices[n_p : n_p + n_d])
        else:
            self.prefill = self.decode = group(devices[:tp] if tp > 1 else None)
        self.host = HostKV(cfg, host_pages, page_size, kv_dtype) if host_pages else None
        self.rope = rope_table_for(cfg)
        self._attn = {
            bq: make_model_attention(cfg, attention_backend, bq, deterministic=deterministic)
            for bq in (DECODE_BLOCK_Q, PREFILL_BLOCK_Q)
        }

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not self.decode

    def run_prefill(self, work: Work) -> StepLogits:
        return self.run(self.prefill, work, PREFILL_BLOCK_Q)

    def run_decode(self, work: Work, previous: StepLogits | None = None) -> StepLogits:
        """``previous``: the last decode step's output, whose greedy rows feed the passes'
        PENDING tokens (``Pass.pending_from``)."""
        return self.run(self.decode, work, DECODE_BLOCK_Q, previous)

    def to_decode(self, pages: list[int]) -> None:
        """Prefill wrote ``pages``: the decode group reads them next (disaggregated)."""
        if self.disaggregated and pages:
            transfer_pages(self.prefill, self.decode, pages)

    def to_prefill(self, pages: list[int]) -> None:
        """Decode wrote ``pages`` (generated tokens entering the cache): later prefills and
        restores read them on the prefill group."""
        if self.disaggregated and pages:
            transfer_pages(self.decode, self.prefill, pages)

    # The host tier's copies (the cache manager's PageMover). Every resident page holds the
    # same KV in both groups, so spills read the prefill group; reloads write both.
    def offload(self, device_pages: list[int], host_pages: list[int]) -> None:
        self.host.offload(self.prefill, device_pages, host_pages)

    def reload(self, host_pages: list[int], device_pages: list[int]) -> None:
        groups = [self.prefill, self.decode] if self.disaggregated else [self.prefill]
        self.host.reload(groups, host_pages, device_pages)

    def run(self, group: DeviceGroup, work: Work, block_q: int,
            previous: StepLogits | None = None) -> StepLogits:
        """Dispatch one forward over ``work`` on ``group``; returns its logits rows (lazy;
        row ``i`` belongs to the ``i``-th pass with a logits row, then padding)."""
        ps = self.page_size
        tokens, q_pos, writes, segs, copies, rows = [], [], [], [], [], []
        pending: list[tuple[int, int]] = []  # (row, row of previous's greedy tokens)
        for _, p in work:
            off = len(tokens)
            if p.pending_from >= 0:
                pending.append((off + len(p.tokens) - 1, p.pending_from))
            tokens += p.tokens
            q_pos += p.q_pos
            writes += p.writes
            segs += [dataclasses.replace(s, q_start=s.q_start + off) for s in p.segments]
            copies += p.copies
            if p.logits_row >= 0:
                rows.append(off + p.logits_row)
        for stage in sorted({c[4] for c in copies}):
            group.rerotate_copy([c[:4] for c in copies if c[4] == stage], self.rope)
        # Padded to few shapes (see token_bucket); the block count follows from the token
        # count (each segment adds at most one partial block).
        T = token_bucket(len(tokens), block_q)
        # Key versions per token: one for a prompt's tokens (each written once); a restore
        # that writes a token at several positions pads to 4, 8, ... Every version rotates
        # and scatters every layer's keys and values for all T rows: a cold 2,000-token
        # prefill padded to 4 did that 4 times over (~1% of its forward).
        versions = max(len(w) for w in writes)
        W = bucket(versions, 1 if block_q == 1 or versions == 1 else 4)
        sentinel = self.num_pages * ps
        slot_arr = np.full((W, T), sentinel, np.int32)
        pos_arr = np.zeros((W, T), np.int32)
        for t, ws in enumerate(writes):
            for w, (sl, pos) in enumerate(ws):
                slot_arr[w, t], pos_arr[w, t] = (sentinel if sl == NO_WRITE else sl), pos
        tok_arr = np.zeros(T, np.int32)
        tok_arr[: len(tokens)] = tokens
        if pending:
            source = np.full(T, -1, np.int32)
            for row, src in pending:
                source[row] = src
            tok_arr = feed_pending(tok_arr, source, previous.greedy)
        qp = np.zeros(T, np.int32)
        qp[: len(q_pos)] = q_pos
        # One segment (a turn's new message after a cached history) gets its own shape: the
        # [segments, view] metadata of 7 padding segments grew with the history.
        ns = 1 if len(segs) == 1 else bucket(len(segs), 8)
        batch = build_segment_batch(
            segs,
            page_size=ps,
            block_q=block_q,
            num_blocks=T if block_q == 1 else T // block_q + ns,
            num_segments=ns,
            max_pages=view_bucket(max(len(s.pages) for s in segs), ps),
            on_device=False,
        )
        # Decode: one logits row per request, padded as tokens are (the vocabulary matmul
        # streams the whole embedding; at 1 row it runs at the memory's speed, see
        # token_bucket): as many as the tokens, unless a pass feeds several tokens of a
        # request (jump-forward), whose rows but the last need no logits. Prefill: one per
        # request, padded to 8 (fewer shapes).
        R = token_bucket(len(rows), 1) if block_q == 1 else bucket(len(rows), 8)
        row_arr = np.zeros(R, np.int32)
        row_arr[: len(rows)] = rows
        # Host arrays: the jitted step moves them all in one go.
        writes_arr = KVWrites(slots=slot_arr, positions=pos_arr)
        return group.forward(
            tok_arr, qp, writes_arr, batch, self.rope, self._attn[block_q], row_arr
        )

    def warm_up_shapes(self, prefill_chunk: int, max_running: int) -> int:
        """Run every step shape of the common path once, so no request pays for a compile
        (or, with the persistent cache, for tracing and loading one): prefill forwards of
        each token bucket up to ``prefill_chunk``, with one segment and with several, and
        decode forwards of each row bucket up to ``max_running``, each at every view bucket
        up to the position limit (no repos). The dummy rows write to the sentinel slot
        (dropped) and see no KV, so the pool is untouched. Returns the number of shapes
        run."""
        ps = self.page_size
        sentinel = self.num_pages * ps
        views = distinct_buckets(
            -(-self.cfg.max_position_embeddings // ps), lambda n: view_bucket(n, ps)
        )

        def dummy(n_rows: int, n_pages: int, n_segs: int = 1) -> Pass:
            cuts = [i * n_rows // n_segs for i in range(n_segs + 1)]
            return Pass(
                tokens=[0] * n_rows,
                q_pos=[0] * n_rows,
                writes=[[(sentinel, 0)] for _ in range(n_rows)],
                segments=[SegmentSpec(q_start=a, q_len=b - a, pages=[0] * n_pages,
                                      kv_visible=np.zeros(n_pages * ps, bool), causal_pos=0)
                          for a, b in zip(cuts, cuts[1:], strict=False)],
                logits_row=n_rows - 1,
            )

        shapes = 0
        out = None
        for n_pages in views:
            for n in distinct_buckets(prefill_chunk, lambda n: token_bucket(n, PREFILL_BLOCK_Q)):
                if n <= n_pages * ps:
                    for n_segs in (1, 2):  # one segment, and several (padded to 8)
                        jax.block_until_ready(
                            self.run_prefill([(None, dummy(n, n_pages, n_segs))]))
                        shapes += 1
            for rows in distinct_buckets(max_running, lambda n: token_bucket(n, 1)):
                out = self.run_decode([(None, dummy(1, n_pages))] * rows)
                # and fed from the last step's greedy rows (overlap): tokens on the device
                fed = dummy(1, n_pages)
                fed.pending_from = 0
                jax.block_until_ready(self.run_decode([(None, fed)] * rows, out))
                shapes += 1
        # Overlap: a decode step's tokens taken from the last one's greedy rows, for every
        # pair of row counts, on the devices (and sharding) the decode forward puts them.
        rows = distinct_buckets(max_running, lambda n: token_bucket(n, 1))
        for t in rows:
            for r in rows:
                greedy = jax.device_put(np.zeros(r, np.int32), out.greedy.sharding)
                jax.block_until_ready(feed_pending(np.zeros(t, np.int32),
                                                   np.full(t, -1, np.int32), greedy))
        return shapes
