"""Deviceless compiles of the serving step, and the memory plan and roofline of each.

The step is :func:`akv_jax.serving.device_group.forward_step`, the jitted function the server
runs each step (embedding, every layer's KV writes and Pallas attention, MoE, logits rows),
compiled from abstract params (``Params.abstract``: no weights) sharded like the server shards
them (:func:`step_cases`). Sampling is not in it: the server samples on the host (numpy,
:mod:`akv_jax.serving.sampler`), from the logits rows this step returns. Its flops and bytes
are counted from the shapes (:func:`step_traffic`), since cost_analysis() counts the layer
scan's body once; :func:`fits` and :func:`kv_pool_tokens` say what fits beside the weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from akv_jax.aot.compiler import (
    PAGE_SIZE,
    Result,
    compile_one,
    roofline_s,
    shape_struct,
    topology_devices,
)
from akv_jax.aot.targets import TARGETS
from akv_jax.model.config import ModelConfig
from akv_jax.model.forward import KVPool, KVWrites, make_model_attention
from akv_jax.model.params import (
    SHARDING_RULES as PARAM_RULES,
)
from akv_jax.model.params import (
    Params,
    is_array_info,
    logical_to_spec,
    make_mesh,
    param_shardings,
)
from akv_jax.model.presets import preset_config
from akv_jax.model.rope import rope_table_for
from akv_jax.pallas.dispatch import make_projection
from akv_jax.pallas.metadata import SegmentSpec, bucket, build_segment_batch
from akv_jax.serving.device_group import KV_AXES, forward_step
from akv_jax.serving.executor import (
    DECODE_BLOCK_Q,
    PREFILL_BLOCK_Q,
    token_bucket,
    view_bucket,
)


@dataclasses.dataclass(frozen=True)
class StepCase:
    model: str
    tp: int
    phase: str  # "decode" or "prefill"
    pool_tokens: int = 16384  # KV pool of the compiled step (the server's default size)
    deterministic: bool = False  # --deterministic: fixed-tile products, no split-K

    @property
    def name(self) -> str:
        mode = " deterministic" if self.deterministic else ""
        return f"step {self.model} TP{self.tp} {self.phase} bf16{mode}"


def step_cases(full: bool = True) -> list[StepCase]:
    """SmolLM2 at TP1 and GPT-OSS-120B at TP4 (the paper's TP4 prefill + TP4 decode groups),
    Qwen3-8B decode at TP1; in CI (not ``full``) the GPT-OSS-120B TP4 decode step, compiled
    for the paper's GPU only (see bench/aot.py)."""
    if not full:
        return [StepCase("GPT-OSS-120B", 4, "decode", 65536)]
    return [
        StepCase("SmolLM2-135M", 1, "decode"),
        StepCase("SmolLM2-135M", 1, "prefill"),
        StepCase("Qwen3-8B", 1, "decode"),
        StepCase("Qwen3-8B", 1, "decode", deterministic=True),
        StepCase("GPT-OSS-120B", 4, "prefill", 65536),
        StepCase("GPT-OSS-120B", 4, "decode", 65536),
    ]


def abstract_params(cfg: ModelConfig, mesh: Any, dtype: Any = jnp.bfloat16) -> Params:
    """The params tree as ShapeDtypeStructs placed like ``shard_params`` places weights."""
    shardings = param_shardings(cfg, mesh)
    return jax.tree.map(
        lambda info, s: jax.ShapeDtypeStruct(info.shape, dtype, sharding=s),
        Params.abstract(cfg), shardings, is_leaf=is_array_info,
    )


def kv_bytes_per_token(cfg: ModelConfig, tp: int, dtype: Any = jnp.bfloat16) -> int:
    """KV pool bytes per token slot on one device (kv heads split over ``tp`` when it divides
    them, as :data:`KV_AXES` shards the pool)."""
    heads = cfg.num_kv_heads // tp if cfg.num_kv_heads % tp == 0 else cfg.num_kv_heads
    return 2 * cfg.num_layers * heads * cfg.head_dim * jnp.dtype(dtype).itemsize


# The steps compiled and estimated: a decode step of 16 running requests (the server's
# default --max-running-requests) over 4,096-token views, and one prefill chunk (the server's
# default --prefill-chunk) on an empty cache.
DECODE_REQUESTS, DECODE_VIEW = 16, 4096
PREFILL_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Host arrays of one step's inputs besides params, pool and RoPE table."""

    tokens: np.ndarray  # [T] int32
    q_pos: np.ndarray  # [T] int32
    writes: KVWrites  # slots and positions, [1, T] int32 each
    batch: Any  # SegmentBatch (numpy leaves)
    block_q: int
    rows: np.ndarray  # logits rows


def step_inputs(case: StepCase, requests: int = DECODE_REQUESTS,
                view: int = DECODE_VIEW) -> StepInputs:
    """The step's inputs as the executor builds them (its buckets): decode, ``requests``
    rows each at the end of its own ``view``-token view (contiguous pages, request ``i``'s
    from page ``i * view / page size``); prefill, one :data:`PREFILL_TOKENS`-token chunk on an
    empty cache. Rows past the real ones write nowhere (a slot past the pool)."""
    ps = PAGE_SIZE
    if case.phase == "decode":
        block_q, n_tok, n_seg = DECODE_BLOCK_Q, requests, requests
    else:
        block_q, n_tok, n_seg, view = PREFILL_BLOCK_Q, PREFILL_TOKENS, 1, PREFILL_TOKENS
    q_len = n_tok // n_seg
    specs = [
        SegmentSpec(q_start=i * q_len, q_len=q_len,
                    pages=list(range(i * view // ps, (i + 1) * view // ps)),
                    kv_visible=np.ones(view, bool), causal_pos=view - q_len)
        for i in range(n_seg)
    ]
    T = token_bucket(n_tok, block_q)
    ns = bucket(n_seg, 8)
    batch = build_segment_batch(
        specs, page_size=ps, block_q=block_q,
        num_blocks=T if block_q == 1 else T // block_q + ns, num_segments=ns,
        max_pages=view_bucket(view // ps, ps), on_device=False,
    )
    q_pos = np.zeros(T, np.int32)
    slots = np.full(T, case.pool_tokens, np.int32)
    rows = np.zeros(ns, np.int32)
    for i in range(n_seg):
        at = np.arange(i * q_len, (i + 1) * q_len)
        q_pos[at] = view - q_len + np.arange(q_len)
        slots[at] = i * view + q_pos[at]
        rows[i] = at[-1]
    writes = KVWrites(slots=slots[None], positions=q_pos[None].copy())
    return StepInputs(np.zeros(T, np.int32), q_pos, writes, batch, block_q, rows)


def step_args(cfg: ModelConfig, case: StepCase, devices: tuple) -> tuple:
    """Arguments of ``forward_step`` as the executor builds them (its buckets), abstract."""
    mesh = make_mesh(case.tp, list(devices[: case.tp]))
    rep = NamedSharding(mesh, PartitionSpec())
    ps = PAGE_SIZE
    P = case.pool_tokens // ps
    kv_shape = (cfg.num_layers, P, ps, cfg.num_kv_heads, cfg.head_dim)
    kv_sh = NamedSharding(mesh, logical_to_spec(KV_AXES, kv_shape, mesh))
    kv = KVPool(k=jax.ShapeDtypeStruct(kv_shape, jnp.bfloat16, sharding=kv_sh),
                v=jax.ShapeDtypeStruct(kv_shape, jnp.bfloat16, sharding=kv_sh))
    inp = step_inputs(case)
    i32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.int32, sharding=rep)
    writes = KVWrites(slots=i32(inp.writes.slots), positions=i32(inp.writes.positions))
    rope = jax.tree.map(lambda x: shape_struct(x, rep), rope_table_for(cfg))
    return mesh, (
        abstract_params(cfg, mesh), cfg, i32(inp.tokens), i32(inp.q_pos), kv, writes,
        jax.tree.map(lambda x: shape_struct(x, rep), inp.batch), rope, inp.block_q, i32(inp.rows),
    )


def step_traffic(cfg: ModelConfig, case: StepCase) -> tuple[float, float]:
    """(flops, HBM bytes) of one step over all devices, counted from the model's shapes.

    XLA's cost_analysis() counts a while loop's body once, and the forward is a scan over
    the layers, so its totals hold one layer; hence this count. Weights are read once per step
    (experts: only those some token routes to, in expectation for uniform routing); every
    token's view of KV is read once per query block (decode: one row per block; prefill: a
    64-row block reads its causal prefix); matmul flops are 2 per weight per token (k experts
    per token), attention 4 * keys * head dim per query head, logits for the returned rows.
    """
    D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    Hq, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn_w = D * Dh * (2 * Hq + 2 * Hkv)
    if cfg.is_moe:
        E, k, F = cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size
        expert = 3 * D * F
        mlp_flops_w, mlp_w = k * expert, None
    else:
        mlp_flops_w = mlp_w = 3 * D * cfg.intermediate_size
    decode = case.phase == "decode"
    if decode:
        T, view, rows = DECODE_REQUESTS, DECODE_VIEW, DECODE_REQUESTS
    else:
        T, view, rows = PREFILL_TOKENS, PREFILL_TOKENS, 1
    if cfg.is_moe:
        touched = E * (1 - (1 - k / E) ** T)
        mlp_w = touched * expert + D * E
    kv_tok = 2 * Hkv * Dh * 2  # bf16 K and V per layer
    if decode:
        keys = T * view  # one query row per request, each over its own view
        kv_read = keys * kv_tok
    else:
        keys = T * (T + 1) // 2  # causal
        kv_read = (T // PREFILL_BLOCK_Q) * (view / 2) * kv_tok
    if cfg.sliding_window:  # half the layers see at most the window
        keys_l = (keys + T * min(cfg.sliding_window, view)) / 2
    else:
        keys_l = keys
    flops = L * (2 * T * (attn_w + mlp_flops_w) + 4 * keys_l * Hq * Dh) + 2 * rows * D * V
    nbytes = 2 * (L * (attn_w + mlp_w) + D * V) + L * kv_read
    return float(flops), float(nbytes)


def compile_step(target_name: str, case: StepCase) -> Result:
    """Compile the server's step (``forward_step``) for ``case`` on ``case.tp`` devices."""
    t = TARGETS[target_name]
    devices = topology_devices(target_name)
    cfg = preset_config(case.model)
    res = Result("step", target_name, case.name, devices=case.tp)
    mesh, (params, cfg, tokens, q_pos, kv, writes, batch, rope, block_q, rows) = step_args(
        cfg, case, devices
    )
    kw = {"num_cores": t.cores} if t.platform == "cuda" else {}
    attention = make_model_attention(cfg, "auto", block_q, platform=t.platform,
                                     deterministic=case.deterministic, **kw)
    projection = make_projection(t.platform, case.deterministic) if case.deterministic else None
    res.extra["kv_bytes_per_token"] = kv_bytes_per_token(cfg, case.tp)
    res.extra["pool_tokens"] = case.pool_tokens
    flops, nbytes = step_traffic(cfg, case)
    res.extra["traffic_flops"], res.extra["traffic_bytes"] = flops, nbytes
    # The server's own jitted step (static cfg, attention and mesh; the pool donated).
    static = dict(mesh=mesh if case.tp > 1 else None, projection=projection)
    step = functools.partial(forward_step, **static)
    step.lower = lambda *a: forward_step.lower(*a, **static)
    compile_one(
        res, t, step,
        (params, cfg, tokens, q_pos, kv, writes, batch, rope, attention, rows), devices[0],
    )
    # The roofline from the shape count (cost_analysis() holds one layer of the scan), split
    # evenly over the tensor-parallel devices.
    res.estimate_s = roofline_s(flops, nbytes, t, case.tp)
    return res


def param_bytes_per_device(cfg: ModelConfig, tp: int, itemsize: int = 2) -> int:
    """Weight bytes on one device under the server's sharding rules (replicated axes whole)."""
    mesh_shape = {"tensor": tp}
    total = 0
    for info in jax.tree.leaves(Params.abstract(cfg), is_leaf=is_array_info):
        n = int(np.prod(info.shape))
        split = any(
            PARAM_RULES.get(ax) in mesh_shape and dim % tp == 0
            for ax, dim in zip(info.axes, info.shape, strict=True)
        )
        total += n * itemsize // (tp if split else 1)
    return total


def fits(target_name: str, case: StepCase) -> tuple[bool, str]:
    """Whether the step's weights and KV pool alone fit the target's HBM per device; a step
    that cannot fit is not compiled (XLA would stop at CompileTimeHbmOom) but reported."""
    t = TARGETS[target_name]
    cfg = preset_config(case.model)
    pool = kv_bytes_per_token(cfg, case.tp) * case.pool_tokens
    need = param_bytes_per_device(cfg, case.tp) + pool
    if need <= t.memory_bytes:
        return True, ""
    return False, (f"does not fit: weights + {case.pool_tokens}-token pool need "
                   f"{need / 1e9:.1f} GB per device, {t.name} has {t.memory_bytes / 1e9:.1f} GB")


def kv_pool_tokens(result: Result, memory_bytes: int) -> int:
    """Tokens of KV pool that fit beside the step in ``memory_bytes`` per device: what the
    compiled step needs apart from its pool (weights and inputs, outputs, temporaries, code)
    is fixed; the rest holds pool pages. An estimate from memory_analysis(), not a run."""
    m = result.memory
    per_tok = result.extra["kv_bytes_per_token"]
    pool = per_tok * result.extra["pool_tokens"]
    fixed = m["argument"] - pool + m["output"] - m["alias"] + m["temp"] + m["generated_code"]
    free = memory_bytes - fixed
    return max(0, free // per_tok) // PAGE_SIZE * PAGE_SIZE
