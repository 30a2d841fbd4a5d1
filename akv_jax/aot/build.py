"""Deviceless compiles of akv_jax for the chips of :mod:`akv_jax.aot.targets`.

No accelerator is needed: ``jax.experimental.topologies.get_topology_desc`` describes the
target (a libtpu topology name, or a ``GpuTargetConfigProto`` for a GPU), arguments are
``jax.ShapeDtypeStruct`` with shardings on that topology's devices, and ``.lower().compile()``
runs the real compiler: Mosaic + XLA:TPU (a block too large for VMEM fails), or XLA:GPU with
Triton -> PTX -> cubin (ptxas reports each kernel's registers and spills).

It needs the toolchains of the ``aot`` extra (``bash scripts/aot.sh`` builds ``.venv-aot``):
``jax[tpu]`` (libtpu), ``jax-cuda12-plugin`` + ``jax-cuda12-pjrt`` and ptxas from
``nvidia-cuda-nvcc-cu12``. Two environment variables must be set before jax starts
(:data:`ENV`; :func:`check_env` says which are missing): the CUDA plugin's check for a local
driver/cuDNN is skipped, and XLA logs ptxas' ``-v`` report, which is where registers and
spills come from.

What is compiled (:func:`kernel_cases`, :func:`step_cases`):

* the two Pallas kernels (segment attention, repos) at decode, prefill and restore shapes for
  each model's head layout, float32 and bfloat16, with sinks and the sliding window where the
  model has them;
* the serving step: :func:`akv_jax.serving.device_group.forward_step`, the jitted function
  the server runs each step (embedding, every layer's KV writes and Pallas attention, MoE,
  logits rows), from abstract params (``Params.abstract``: no weights) sharded like the
  server shards them. Sampling is not in it: the server samples on the host (numpy,
  :mod:`akv_jax.serving.sampler`), from the logits rows this step returns.

Every figure that is not read from the compiler (step time) is an *estimate*: a roofline
``max(flops / peak, bytes / bandwidth)`` with the data-sheet peaks. For a kernel, flops and
bytes are ``cost_analysis()``'s (a Pallas call counts its operands' bytes: the whole page
pool, so an upper bound); for a step they are counted from the shapes
(:func:`step_traffic`), because cost_analysis() counts the layer scan's body once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from akv_jax.aot.targets import TARGETS, Target, gpu_target_config
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
from akv_jax.model.rope import make_rope_table, rope_table_for
from akv_jax.pallas.dispatch import make_repos_fn
from akv_jax.pallas.metadata import SegmentSpec, bucket, build_segment_batch
from akv_jax.pallas.segment_attention_gpu import segment_attention_gpu
from akv_jax.pallas.segment_attention_tpu import segment_attention_tpu
from akv_jax.serving.device_group import KV_AXES, forward_step
from akv_jax.serving.executor import (
    DECODE_BLOCK_Q,
    PREFILL_BLOCK_Q,
    token_bucket,
    view_bucket,
)

# Set before jax initialises its backends (scripts/aot.sh and bench/aot.py do).
ENV = {
    # No driver or cuDNN here: the CUDA plugin would refuse to load without this.
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
    # XLA runs ptxas with -v and logs its report at VLOG(2) of subprocess_compilation.
    "TF_CPP_MIN_LOG_LEVEL": "0",
    "TF_CPP_VMODULE": "subprocess_compilation=2",
    # libtpu takes a machine-wide lock file for the chip it drives; there is none here, so
    # two compiling processes (CI's, a developer's) must not exclude each other.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}

PAGE_SIZE = 16  # the server's default --page-size
# GPT-OSS-20B and -120B share one attention layout (64 q / 8 kv heads of 64, sinks, window
# 128): their kernel compiles are the same program, so the -120B name stands for both.
KERNEL_LAYOUTS = ("SmolLM2-135M", "Qwen3-8B", "GPT-OSS-120B")
PHASES = ("decode", "prefill", "restore")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def check_env() -> list[str]:
    """The :data:`ENV` entries missing from this process's environment."""
    return [f"{k}={v}" for k, v in ENV.items() if os.environ.get(k) != v]


# ---------------------------------------------------------------------------------------
# Topologies


@functools.cache
def topology_devices(target_name: str, n: int = 4) -> tuple[Any, ...]:
    """``n`` abstract devices of the target (a four-chip TPU slice; a 1x1xn GPU host)."""
    from jax.experimental import topologies

    t = TARGETS[target_name]
    if t.platform == "tpu":
        topo = topologies.get_topology_desc(topology_name=t.topology, platform="tpu")
    else:
        topo = topologies.get_topology_desc(
            platform="cuda", topology_name="", target_config=gpu_target_config(t),
            topology=f"1x1x{n}",
        )
    devices = tuple(topo.devices)
    if len(devices) < n:
        raise ValueError(f"{target_name}: topology has {len(devices)} devices, need {n}")
    return devices[:n]


# ---------------------------------------------------------------------------------------
# Reading the compiler's reports


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Redirect file descriptor 2 (where XLA's C++ logging writes) into a list of one string.

    ptxas' report reaches us only as XLA log lines, so the compile runs with fd 2 pointed at
    a temporary file.
    """
    out: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out.append(f.read().decode(errors="replace"))


_PTXAS = re.compile(
    r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>sm_\w+)'.*?"
    r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, "
    r"(?P<ld>\d+) bytes spill loads.*?Used (?P<regs>\d+) registers",
    re.S,
)


def ptxas_reports(log: str) -> dict[str, dict[str, int]]:
    """``{kernel: {registers, spill_stores, spill_loads, stack}}`` from ptxas ``-v`` output."""
    out = {}
    for m in _PTXAS.finditer(log):
        out[m["name"]] = dict(
            registers=int(m["regs"]), spill_stores=int(m["st"]), spill_loads=int(m["ld"]),
            stack=int(m["stack"]),
        )
    return out


def tpu_kernel_vmem(hlo_text: str, kernel_names: tuple[str, ...]) -> dict[str, int]:
    """Scoped VMEM bytes each named Mosaic kernel uses, from the compiled HLO's custom calls
    (``used_scoped_memory_configs``, memory space 1 = VMEM)."""
    out: dict[str, int] = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?(\S+) = .*custom_call_target=\"tpu_custom_call\"", line)
        if not m:
            continue
        name = m[1].split(".")[0]
        if not any(name.startswith(k) for k in kernel_names):
            continue
        used = re.search(r'"used_scoped_memory_configs":\[([^\]]*)\]', line)
        vmem = r'"memory_space":"1","offset":"\d+","size":"(\d+)"'
        sizes = re.findall(vmem, used[1]) if used else []
        out[name] = max(out.get(name, 0), sum(int(s) for s in sizes))
    return out


def _cost(lowered: Any, compiled: Any) -> dict[str, float]:
    """flops and bytes accessed. XLA:TPU reports them for the compiled (partitioned, fused)
    program; the deviceless XLA:GPU compile reports none, so there the lowered (global,
    unfused) program's HLO cost analysis is used, on the CPU client."""
    ca = compiled.cost_analysis()
    if isinstance(ca, list):
        ca = ca[0] if ca else None
    if ca and "flops" in ca:
        return dict(flops=float(ca.get("flops", 0.0)), bytes=float(ca.get("bytes accessed", 0.0)),
                    cost_source="compiled")
    from jax._src.lib import _jax

    hlo = lowered.compiler_ir("hlo").as_hlo_module()
    ca = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, hlo)
    return dict(flops=float(ca.get("flops", 0.0)), bytes=float(ca.get("bytes accessed", 0.0)),
                cost_source="lowered")


@dataclasses.dataclass
class Result:
    kind: str  # "attention", "repos" or "step"
    target: str
    name: str  # e.g. "GPT-OSS-120B decode bf16 sinks+window"
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    devices: int = 1
    kernels: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # GPU: ptxas
    vmem: dict[str, int] = dataclasses.field(default_factory=dict)  # TPU: scoped VMEM bytes
    memory: dict[str, int] = dataclasses.field(default_factory=dict)  # memory_analysis()
    flops: float = 0.0
    bytes: float = 0.0
    cost_source: str = ""
    estimate_s: float = 0.0  # roofline estimate per device (see module docstring)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def spills(self) -> int:
        return sum(k["spill_stores"] + k["spill_loads"] for k in self.kernels.values())


def compile_one(
    result: Result, target: Target, fn: Callable[..., Any], args: tuple, device: Any
) -> Result:
    """Lower and compile ``fn(*args)`` for ``target``; fill ``result`` with what the compiler
    reports. A compile error is recorded (``ok=False``), not raised."""
    t0 = time.perf_counter()
    try:
        with captured_stderr() as log, jax.default_device(device):
            lowered = jax.jit(fn).lower(*args) if not hasattr(fn, "lower") else fn.lower(*args)
            compiled = lowered.compile()
        result.ok = True
    except Exception as e:  # the compiler's verdict is the result
        result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}"
        result.seconds = time.perf_counter() - t0
        return result
    result.seconds = time.perf_counter() - t0
    if target.platform == "cuda":
        reports = ptxas_reports(log[0])
        # akv_jax's Pallas kernels by name; XLA's own fusions summarised.
        result.kernels = {k: v for k, v in reports.items() if k.startswith("akv_")}
        xla = [v for k, v in reports.items() if not k.startswith("akv_")]
        result.extra["xla_kernels"] = dict(
            count=len(xla), max_registers=max((v["registers"] for v in xla), default=0),
            spill_bytes=sum(v["spill_stores"] + v["spill_loads"] for v in xla),
        )
    else:
        result.vmem = tpu_kernel_vmem(compiled.as_text(), ("akv_", "repos"))
    mem = compiled.memory_analysis()
    if mem is not None:
        result.memory = {
            k: int(getattr(mem, f"{k}_size_in_bytes"))
            for k in ("argument", "output", "alias", "temp", "generated_code")
        }
    result.__dict__.update(_cost(lowered, compiled))
    per_dev = result.devices if result.cost_source == "lowered" else 1
    result.estimate_s = roofline_s(result.flops, result.bytes, target, per_dev)
    return result


def roofline_s(flops: float, nbytes: float, target: Target, devices: int = 1) -> float:
    """The roofline estimate of a program's time: ``max(flops / peak, bytes / bandwidth)``
    per device, the work split evenly over ``devices``, at the data-sheet peaks."""
    return max(flops / devices / target.peak_bf16_flops,
               nbytes / devices / target.hbm_bytes_per_s)


# ---------------------------------------------------------------------------------------
# Kernel cases


def _segment_batch(phase: str, ps: int):
    """(segments, block_q, query rows, pool pages) for a phase, with realistic sizes:
    decode: 16 requests (the server's default --max-running-requests) over 4,096-token views,
    a quarter of each dropped; prefill: a 512-token segment after a 1,536-token cached prefix;
    restore: four 256-token segments, each seeing the KV of the ones before it (one-pass
    restore of a four-turn history)."""
    specs, page = [], 0
    if phase == "decode":
        block_q, n = DECODE_BLOCK_Q, 4096
        for r in range(16):
            vis = np.ones(n, bool)
            vis[512:1536] = False  # a dropped tool response
            specs.append(SegmentSpec(q_start=r, q_len=1, pages=list(range(page, page + n // ps)),
                                     kv_visible=vis, causal_pos=n - 1))
            page += n // ps
        rows = 16
    elif phase == "prefill":
        block_q, n = PREFILL_BLOCK_Q, 2048
        specs.append(SegmentSpec(q_start=0, q_len=512, pages=list(range(n // ps)),
                                 kv_visible=np.ones(n, bool), causal_pos=n - 512))
        page, rows = n // ps, 512
    else:
        block_q, seg = PREFILL_BLOCK_Q, 256
        for i in range(4):
            n = (i + 1) * seg
            specs.append(SegmentSpec(q_start=i * seg, q_len=seg, pages=list(range(n // ps)),
                                     kv_visible=np.ones(n, bool), causal_pos=i * seg))
        page, rows = 4 * seg // ps, 4 * seg
    batch = build_segment_batch(specs, page_size=ps, block_q=block_q)
    return batch, block_q, rows, page + 8


def _sds(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


@dataclasses.dataclass(frozen=True)
class KernelCase:
    kernel: str  # "attention" or "repos"
    model: str  # a preset whose head layout is used
    phase: str  # decode / prefill / restore ("-" for repos)
    dtype: str  # "f32" or "bf16"

    @property
    def name(self) -> str:
        cfg = preset_config(self.model)
        extras = "+sinks+window" if cfg.attention_sinks and self.kernel == "attention" else ""
        return f"{self.kernel} {self.model} {self.phase} {self.dtype}{extras}"


def kernel_cases(full: bool = True) -> list[KernelCase]:
    """Every layout x phase x dtype (``full``), or the CI set: attention at decode bf16 for
    head dim 128 (Qwen3-8B) and for sinks + window (GPT-OSS), repos at head dim 128."""
    if not full:
        return [KernelCase("attention", "Qwen3-8B", "decode", "bf16"),
                KernelCase("attention", "GPT-OSS-120B", "decode", "bf16"),
                KernelCase("repos", "Qwen3-8B", "-", "bf16")]
    out = [KernelCase("attention", m, p, d) for m in KERNEL_LAYOUTS for p in PHASES for d in DTYPES]
    out += [KernelCase("repos", m, "-", d) for m in KERNEL_LAYOUTS for d in DTYPES]
    return out


def compile_kernel(
    target_name: str, case: KernelCase, block_q: int | None = None, **kernel_options: Any
) -> Result:
    """Compile one kernel case for one target (on one device of it). ``block_q`` and
    ``kernel_options`` (to the attention body) override the phase's block: an oversized one
    shows a target refusing it."""
    t = TARGETS[target_name]
    dev = topology_devices(target_name)[0]
    sh = SingleDeviceSharding(dev)
    cfg = preset_config(case.model)
    dt = DTYPES[case.dtype]
    Hq, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    res = Result(case.kernel, target_name, case.name)
    if case.kernel == "repos":
        P, n = 4096, 64
        args = (
            jax.ShapeDtypeStruct((P, PAGE_SIZE, Hkv, Dh), dt, sharding=sh),
            jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sh),
            jax.ShapeDtypeStruct((n, PAGE_SIZE), jnp.int32, sharding=sh),
            jax.ShapeDtypeStruct((n, PAGE_SIZE), jnp.int32, sharding=sh),
            jax.tree.map(lambda x: _sds(x, sh), make_rope_table(cfg.rope, Dh, 8192)),
        )
        repos = make_repos_fn("auto", platform=t.platform)
        return compile_one(res, t, repos, args, dev)
    batch, phase_block_q, rows, pages = _segment_batch(case.phase, PAGE_SIZE)
    block_q = block_q or phase_block_q
    body = segment_attention_gpu if t.platform == "cuda" else segment_attention_tpu
    kw = dict(kernel_options)
    if t.platform == "cuda":
        kw.setdefault("num_cores", t.cores)
    window = cfg.sliding_window if cfg.sliding_window else None
    fn = functools.partial(body, block_q=block_q, sm_scale=Dh**-0.5, sliding_window=window, **kw)
    args = [
        jax.ShapeDtypeStruct((rows, Hq, Dh), dt, sharding=sh),
        jax.ShapeDtypeStruct((pages, PAGE_SIZE, Hkv, Dh), dt, sharding=sh),
        jax.ShapeDtypeStruct((pages, PAGE_SIZE, Hkv, Dh), dt, sharding=sh),
        jax.tree.map(lambda x: _sds(x, sh), batch),
    ]
    if cfg.attention_sinks:
        sinks = jax.ShapeDtypeStruct((Hq,), jnp.float32, sharding=sh)
        fn = functools.partial(lambda f, q, k, v, b, s: f(q, k, v, b, sinks=s), fn)
        args.append(sinks)
    return compile_one(res, t, fn, tuple(args), dev)


# ---------------------------------------------------------------------------------------
# Serving steps


@dataclasses.dataclass(frozen=True)
class StepCase:
    model: str
    tp: int
    phase: str  # "decode" or "prefill"
    pool_tokens: int = 16384  # KV pool of the compiled step (the server's default size)

    @property
    def name(self) -> str:
        return f"step {self.model} TP{self.tp} {self.phase} bf16"


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
    rope = jax.tree.map(lambda x: _sds(x, rep), rope_table_for(cfg))
    return mesh, (
        abstract_params(cfg, mesh), cfg, i32(inp.tokens), i32(inp.q_pos), kv, writes,
        jax.tree.map(lambda x: _sds(x, rep), inp.batch), rope, inp.block_q, i32(inp.rows),
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
    attention = make_model_attention(cfg, "auto", block_q, platform=t.platform, **kw)
    res.extra["kv_bytes_per_token"] = kv_bytes_per_token(cfg, case.tp)
    res.extra["pool_tokens"] = case.pool_tokens
    flops, nbytes = step_traffic(cfg, case)
    res.extra["traffic_flops"], res.extra["traffic_bytes"] = flops, nbytes
    # The server's own jitted step (static cfg, attention and mesh; the pool donated).
    step = functools.partial(forward_step, mesh=mesh if case.tp > 1 else None)
    step.lower = lambda *a: forward_step.lower(*a, mesh=mesh if case.tp > 1 else None)
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
