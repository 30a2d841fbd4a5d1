"""Deviceless compiles of the Pallas kernels: segment attention, repos and the fixed-tile
matmul of deterministic serving.

Attention at decode, prefill and restore shapes for each model's head layout, float32 and
bfloat16, with sinks and the sliding window where the model has them (:func:`kernel_cases`),
compiled on one device of the target by :func:`akv_jax.aot.compiler.compile_one`, which
reads back the registers and spills (GPU) or scoped VMEM (TPU) of each kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from akv_jax.aot.compiler import PAGE_SIZE, Result, compile_one, shape_struct, topology_devices
from akv_jax.aot.targets import TARGETS
from akv_jax.model.presets import preset_config
from akv_jax.model.rope import make_rope_table
from akv_jax.pallas.dispatch import make_repos_fn
from akv_jax.pallas.matmul import fixed_tile_matmul
from akv_jax.pallas.metadata import SegmentBatch, SegmentSpec, build_segment_batch
from akv_jax.pallas.segment_attention_gpu import segment_attention_gpu
from akv_jax.pallas.segment_attention_tpu import segment_attention_tpu
from akv_jax.serving.executor import DECODE_BLOCK_Q, PREFILL_BLOCK_Q

# GPT-OSS-20B and -120B share one attention layout (64 q / 8 kv heads of 64, sinks, window
# 128): their kernel compiles are the same program, so the -120B name stands for both.
KERNEL_LAYOUTS = ("SmolLM2-135M", "Qwen3-8B", "GPT-OSS-120B")
PHASES = ("decode", "prefill", "restore")
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def _segment_batch(phase: str, ps: int) -> tuple[SegmentBatch, int, int, int]:
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



@dataclasses.dataclass(frozen=True)
class KernelCase:
    kernel: str  # "attention", "repos" or "matmul"
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
    head dim 128 (Qwen3-8B) and for sinks + window (GPT-OSS), repos at head dim 128, the
    fixed-tile matmul at a decode step of Qwen3-8B's MLP and of a tied vocabulary head (the
    embedding read transposed in place), bf16."""
    if not full:
        return [KernelCase("attention", "Qwen3-8B", "decode", "bf16"),
                KernelCase("attention", "GPT-OSS-120B", "decode", "bf16"),
                KernelCase("repos", "Qwen3-8B", "-", "bf16"),
                KernelCase("matmul", "Qwen3-8B", "decode", "bf16"),
                KernelCase("matmul", "Qwen3-8B", "head", "bf16")]
    out = [KernelCase("attention", m, p, d) for m in KERNEL_LAYOUTS for p in PHASES for d in DTYPES]
    out += [KernelCase("repos", m, "-", d) for m in KERNEL_LAYOUTS for d in DTYPES]
    out += [KernelCase("matmul", "Qwen3-8B", p, d) for p in ("decode", "prefill", "head")
            for d in DTYPES]
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
    if case.kernel == "matmul":
        # The MLP's up projection (16 decode rows or a 512-row slice), or 16 rows of a tied
        # head: x @ embed.T, the embedding [V, D] read in place.
        rows = 512 if case.phase == "prefill" else 16
        head = case.phase == "head"
        w = (cfg.vocab_size, cfg.hidden_size) if head else (cfg.hidden_size,
                                                            cfg.intermediate_size)
        args = (jax.ShapeDtypeStruct((rows, cfg.hidden_size), dt, sharding=sh),
                jax.ShapeDtypeStruct(w, dt, sharding=sh))
        fn = functools.partial(fixed_tile_matmul, platform=t.platform, transpose_w=head)
        return compile_one(res, t, fn, args, dev)
    if case.kernel == "repos":
        P, n = 4096, 64
        args = (
            jax.ShapeDtypeStruct((P, PAGE_SIZE, Hkv, Dh), dt, sharding=sh),
            jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sh),
            jax.ShapeDtypeStruct((n, PAGE_SIZE), jnp.int32, sharding=sh),
            jax.ShapeDtypeStruct((n, PAGE_SIZE), jnp.int32, sharding=sh),
            jax.tree.map(lambda x: shape_struct(x, sh), make_rope_table(cfg.rope, Dh, 8192)),
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
        jax.tree.map(lambda x: shape_struct(x, sh), batch),
    ]
    if cfg.attention_sinks:
        sinks = jax.ShapeDtypeStruct((Hq,), jnp.float32, sharding=sh)
        fn = functools.partial(lambda f, q, k, v, b, s: f(q, k, v, b, sinks=s), fn)
        args.append(sinks)
    return compile_one(res, t, fn, tuple(args), dev)

