"""The device side of the engine: one group of devices holding params and a KV pool.

A group picks its projection backend once (:func:`akv_jax.pallas.dispatch.make_projection`)
and holds the weights once, in the layout that backend reads: on the CPU
(:func:`cpu_layout`) the float32 projection stacks packed for its kernels, read in place by
every step's layer scan, the stacks as loaded dropped.

Colocated serving uses one group (one device, or a ``("data", "tensor")`` mesh for
``--tp``). Disaggregated serving (``--disaggregate P,D``) uses two: prefill (and restores) run
on the first, decode on the second, and the pages each writes are handed to the other
(:func:`transfer_pages`) before anyone there reads them. Both pools use the same page ids,
so the host-side page pool and radix tree stay single.

Re-rotated copies (:meth:`DeviceGroup.rerotate_copy`: a resident key copied into another
position version's slot, ``K' = R(new) R(old)^-1 K``, V copied) go through the repos kernel
picked by :func:`akv_jax.pallas.dispatch.make_repos_fn` for the group's attention backend
(the kernel on GPU and TPU, or with "pallas" anywhere; the jnp reference otherwise). The
kernel rotates whole pages in place, while a copy must leave its source (another version that
other requests still read) untouched and may land anywhere: so the source keys are gathered
into temporary pages of :data:`COPY_PAGE` slots, rotated there in one kernel call for every
layer, and scattered to their destination slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from akv_jax.kernels.cpu.projection import CPU, pack_stack
from akv_jax.kernels.projection import Projection
from akv_jax.model.config import ModelConfig
from akv_jax.model.forward import (
    PROJECTION_IN_AXES,
    Attention,
    KVPool,
    KVWrites,
    forward,
)
from akv_jax.model.params import Params, logical_to_spec, make_mesh, shard_params, stack_row
from akv_jax.model.row_sum import row_logsumexp
from akv_jax.pallas.dispatch import make_projection, make_repos_fn
from akv_jax.pallas.metadata import SegmentBatch, bucket
from akv_jax.pallas.rotary import RopeTable

KV_AXES = ("layer", "page", "slot", "kv_heads", "head_dim")
COPY_PAGE = 8  # slots per temporary page of re-rotated copies (a power of two, as Triton needs)


class DeviceGroup:
    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        num_pages: int,
        page_size: int,
        dtype,
        devices: list | None = None,
        attention_backend: str = "auto",
        projection: Projection | None = None,
    ):
        """``devices``: None for the default device; else a tensor-parallel mesh over them.
        ``attention_backend`` ("auto", "reference" or "pallas") picks the re-rotation kernel
        the same way it picks attention. ``projection``: the products' backend (default: the
        platform's, :func:`~akv_jax.pallas.dispatch.make_projection`)."""
        self.cfg = cfg
        self._repos = make_repos_fn(attention_backend)
        self.mesh = None
        self.kv_sharding = None
        kv = KVPool.zeros(cfg, num_pages, page_size, dtype)
        if devices is not None:
            # Params and the KV pool carry named shardings; jit (GSPMD) partitions each step.
            self.mesh = make_mesh(len(devices), devices)
            params = shard_params(params, cfg, self.mesh)
            spec = logical_to_spec(KV_AXES, kv.k.shape, self.mesh)
            self.kv_sharding = NamedSharding(self.mesh, spec)
            kv = jax.device_put(kv, self.kv_sharding)
        else:
            # Committed from the start: a host-tier reload or a page hand-over commits it
            # (device_put), and a committed pool is another jit signature, so every step
            # shape warmed up with an uncommitted one would compile again mid-serving.
            kv = jax.device_put(kv, jax.local_devices()[0])
        self.kv = kv
        self.projection: Projection = projection or make_projection()
        # On the CPU (one device), the layout its kernels read.
        self.params = params
        if self.mesh is None and self.projection is CPU:
            self.params = cpu_layout(cfg, params)

    def forward(
        self,
        tokens: np.ndarray | jax.Array,
        q_pos: np.ndarray,
        writes: KVWrites,
        batch: SegmentBatch,
        rope: RopeTable,
        attention,
        rows: np.ndarray,
    ) -> StepLogits:
        """Run one step; returns its logits rows and their greedy summary (still on device,
        so dispatch stays async)."""
        out, kv = forward_step(
            self.params,
            self.cfg,
            tokens,
            q_pos,
            self.kv,
            writes,
            batch,
            rope,
            attention,
            rows,
            mesh=self.mesh,
            projection=self.projection,
        )
        self.kv = kv
        if not out.logits.is_fully_addressable:  # a mesh over several processes (multi-host)
            from jax.experimental import multihost_utils

            out = StepLogits(*(multihost_utils.process_allgather(a, tiled=True) for a in out))
        return out

    def rerotate_copy(self, copies: list[tuple[int, int, int, int]], rope: RopeTable) -> None:
        """Copy (src slot, dst slot, old pos, new pos) entries, keys re-rotated."""
        n = bucket(len(copies), COPY_PAGE)
        P, ps = self.kv.k.shape[1], self.kv.k.shape[2]
        arr = np.zeros((4, n), np.int32)
        arr[1] = P * ps  # padding copies write out of range
        arr[:, : len(copies)] = np.asarray(copies, np.int32).T
        self.kv = rerotate_copy_pool(
            self.kv, *(jnp.asarray(a) for a in arr), rope, self._repos, mesh=self.mesh
        )


def cpu_layout(cfg: ModelConfig, params: Params) -> Params:
    """The weights of a one-device CPU group: the stacks with their float32 projections
    packed for the kernels (:class:`~akv_jax.kernels.cpu.projection.PackedStack`), which
    every step's layer scan reads in place (no copy of a weight per layer: a scan slices the
    other stacks, XLA:CPU copying each slice), and which the GEMM reads at every row count.
    Each weight is held once; the stacks as loaded are not kept (docs/cpu-kernels.md)."""
    packed = {}
    for name, n_in in PROJECTION_IN_AXES.items():
        rows = [stack_row(cfg, name, i) or 0 for i in range(cfg.num_layers)]
        stack = pack_stack(getattr(params.layers, name), n_in, rows)
        if stack is not None:
            packed[name] = stack
    return dataclasses.replace(params, layers=dataclasses.replace(params.layers, **packed))


def transfer_pages(src: DeviceGroup, dst: DeviceGroup, pages: list[int]) -> None:
    """Hand KV pages from one group to the other (same page ids on both sides)."""
    if not pages or src is dst:
        return
    P = src.kv.k.shape[1]
    n = bucket(len(pages), 8)
    idx = np.full(n, P, np.int32)
    idx[: len(pages)] = pages
    k, v = gather_pages(src.kv, jnp.asarray(np.minimum(idx, P - 1)))
    target = dst.kv_sharding
    if target is not None:
        k, v = jax.device_put(k, target), jax.device_put(v, target)
    else:
        dev = next(iter(dst.kv.k.devices()))
        k, v = jax.device_put(k, dev), jax.device_put(v, dev)
    dst.kv = scatter_pages(dst.kv, jnp.asarray(idx), k, v)


class StepLogits(NamedTuple):
    """A step's logits rows [R, V] and, computed inside the step so that a greedy request
    needs only these few numbers on the host, each row's greedy token (the first index of
    its largest logit), that token's log-probability under the row's log-softmax, and
    whether the row is usable (no NaN or +inf, a finite value): rows that are not go to the
    host sampler, which raises its error."""

    logits: jax.Array
    greedy: jax.Array  # [R] int32
    greedy_logprob: jax.Array  # [R] float32
    ok: jax.Array  # [R] bool


def greedy_rows(logits: jax.Array) -> StepLogits:
    logits = logits.astype(jnp.float32)
    ok = ~jnp.any(jnp.isnan(logits) | jnp.isposinf(logits), axis=-1)
    ok &= jnp.any(jnp.isfinite(logits), axis=-1)
    m = jnp.max(logits, axis=-1)
    lse = row_logsumexp(logits)
    return StepLogits(logits, jnp.argmax(logits, axis=-1).astype(jnp.int32), m - lse, ok)


@jax.jit
def masked_greedy(logits: jax.Array, rows: jax.Array, bits: jax.Array):
    """Rows ``rows`` of ``logits`` [R, V] under grammar masks ``bits`` [k, ceil(V/32)] (id
    ``i`` allowed where bit ``i % 32`` of word ``i // 32`` is set, llguidance's layout):
    each row's first largest allowed logit and its log-probability under the row's own
    log-softmax (the model's, unmasked). Runs after the step's forward, so a constrained
    greedy row never brings its logits to the host."""
    x = logits[rows].astype(jnp.float32)
    ids = jnp.arange(x.shape[-1], dtype=jnp.uint32)
    words = bits.astype(jnp.uint32)[:, ids // 32]
    allowed = ((words >> (ids % 32)) & 1).astype(bool)
    tok = jnp.argmax(jnp.where(allowed, x, -jnp.inf), axis=-1).astype(jnp.int32)
    lse = row_logsumexp(x)
    return tok, jnp.take_along_axis(x, tok[:, None], axis=-1)[:, 0] - lse


@jax.jit
def feed_pending(tokens: jax.Array, source: jax.Array, greedy: jax.Array) -> jax.Array:
    """``tokens`` with each row ``i`` where ``source[i] >= 0`` replaced by
    ``greedy[source[i]]``: the tokens a step feeds that the previous step's greedy rows
    chose, taken on the device without waiting for them (overlap scheduling)."""
    return jnp.where(source >= 0, greedy[jnp.maximum(source, 0)], tokens)


@functools.partial(jax.jit, static_argnames=("cfg", "attention", "mesh", "projection"),
                   donate_argnums=(4,))
def forward_step(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    q_pos: jax.Array,
    kv: KVPool,
    writes: KVWrites,
    batch: SegmentBatch,
    rope: RopeTable,
    attention: Attention,
    rows: jax.Array,
    mesh: jax.sharding.Mesh | None = None,
    projection: Projection | None = None,
) -> tuple[StepLogits, KVPool]:
    """One serving step. ``mesh``: the group's tensor-parallel mesh, made the context mesh
    so that the Pallas kernels run per head shard (see ``dispatch._per_head_shard``).
    ``projection``: the group's backend, which reads ``params`` in its layout (None: the
    platform's, as ``forward``'s)."""
    if mesh is None:
        logits, kv = forward(params, cfg, tokens, q_pos, kv, writes, batch, rope, attention,
                             rows, projection)
    else:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            logits, kv = forward(params, cfg, tokens, q_pos, kv, writes, batch, rope,
                                 attention, rows, projection)
    return greedy_rows(logits), kv


@functools.partial(jax.jit, static_argnames=("repos", "mesh"), donate_argnums=(0,))
def rerotate_copy_pool(kv: KVPool, src, dst, old_pos, new_pos, rope, repos, mesh=None) -> KVPool:
    """Copy keys (re-rotated old_pos -> new_pos) and values from slots ``src`` to ``dst``
    (``len(src)`` a multiple of :data:`COPY_PAGE`); ``repos`` is a ``make_repos_fn`` function.
    ``mesh``: the group's tensor-parallel mesh (the repos kernel runs per head shard)."""
    if mesh is None:
        return _rerotate_copy_body(kv, src, dst, old_pos, new_pos, rope, repos)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return _rerotate_copy_body(kv, src, dst, old_pos, new_pos, rope, repos)


def _rerotate_copy_body(kv: KVPool, src, dst, old_pos, new_pos, rope, repos) -> KVPool:
    L, P, ps, H, D = kv.k.shape
    n = src.shape[0]
    k = kv.k.reshape(L, P * ps, H, D)
    v = kv.v.reshape(L, P * ps, H, D)
    # Temporary page l * n/COPY_PAGE + j holds layer l's copies j*COPY_PAGE .. (j+1)*COPY_PAGE.
    tmp = k[:, src].reshape(L * n // COPY_PAGE, COPY_PAGE, H, D)
    per_layer = (n // COPY_PAGE, COPY_PAGE)
    old = jnp.tile(old_pos.reshape(per_layer), (L, 1))
    new = jnp.tile(new_pos.reshape(per_layer), (L, 1))
    k_src = repos(tmp, jnp.arange(tmp.shape[0], dtype=jnp.int32), old, new, rope)
    k = k.at[:, dst].set(k_src.reshape(L, n, H, D), mode="drop")
    v = v.at[:, dst].set(v[:, src], mode="drop")
    return KVPool(k=k.reshape(kv.k.shape), v=v.reshape(kv.v.shape))


@jax.jit
def gather_pages(kv: KVPool, pages):
    return kv.k[:, pages], kv.v[:, pages]


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_pages(kv: KVPool, pages, k, v) -> KVPool:
    return KVPool(
        k=kv.k.at[:, pages].set(k, mode="drop"), v=kv.v.at[:, pages].set(v, mode="drop")
    )
