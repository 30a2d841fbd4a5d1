"""Micro-benchmark: segment-batch attention kernel vs the jnp reference.

On a GPU or TPU: decode batches (1-64 requests, contexts 1k-32k, 0-90% of the context
dropped) and one-pass restores of rolling-drop histories (contexts 1k-32k), timed for the
platform's kernel body and for the reference; reports achieved HBM bandwidth (the KV bytes the
batch must read, over time) and TFLOP/s (4 * Dh * Hq per attended (query, key) pair) against
the device's peak, writes ``bench/results/kernels.json`` and ends with one summary line.

On the CPU it runs one small decode shape through the GPU body in interpret mode, checks it
against the reference and writes ``bench/results/kernels_cpu_smoke.json`` (a smoke test: the
timings mean nothing).

    python bench/kernels.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import median_seconds, tests_module

from akv_jax.pallas.dispatch import resolve_backend
from akv_jax.pallas.reference import segment_attention_reference
from akv_jax.pallas.segment_attention_gpu import segment_attention_gpu
from akv_jax.pallas.segment_attention_tpu import segment_attention_tpu

cases = tests_module("pallas_cases")

RESULTS = Path(__file__).resolve().parent / "results"

# Peak HBM bandwidth (GB/s) and dense bf16 TFLOP/s by device-kind substring (vendor data).
PEAKS = {
    "H200": (4800, 989),
    "H100": (3350, 989),
    "GH200": (4000, 989),
    "A100": (2039, 312),
    "B200": (8000, 2250),
    "L40": (864, 362),
    "L4": (300, 121),
    "TPU v4": (1228, 275),
    "TPU v5 lite": (819, 197),
    "TPU v5e": (819, 197),
    "TPU v5p": (2765, 459),
    "TPU v5": (2765, 459),
    "TPU v6 lite": (1640, 918),
    "TPU v6e": (1640, 918),
}

# A GQA model shape (Llama-3-8B / Qwen3-8B attention): 8 kv heads, groups of 4, head dim 128.
MODEL = dict(hkv=8, group=4, head_dim=128)
SMOKE_MODEL = dict(hkv=2, group=2, head_dim=32)


def device_peaks(kind: str) -> tuple[float | None, float | None]:
    for key in sorted(PEAKS, key=len, reverse=True):
        if key in kind:
            return PEAKS[key]
    return None, None


def shapes(quick: bool):
    batches = (1, 64) if quick else (1, 8, 64)
    contexts = (1024, 32768) if quick else (1024, 8192, 32768)
    drops = (0.0, 0.9) if quick else (0.0, 0.5, 0.9)
    for b in batches:
        for c in contexts:
            for d in drops:
                yield "decode", dict(batch=b, context=c, drop=d)
    for c in contexts:
        for d in drops:
            yield "restore", dict(batch=1, context=c, drop=d)


def build(kind: str, p: dict, page_size: int, rng: np.random.Generator) -> cases.Case:
    if kind == "decode":
        return cases.decode_case(
            rng, [p["context"]] * p["batch"], page_size=page_size, drop_fraction=p["drop"],
            span=512,
        )
    return cases.history_case(
        rng, p["context"], msg_len=512, drop_fraction=p["drop"], page_size=page_size,
        block_q=64,
    )


def run_one(kind, p, *, body, page_size, dtype, iters, peaks, model=MODEL, interpret=False):
    """Time one shape; sizes of the work come from the case itself (what is visible)."""
    hkv, group, head_dim = model["hkv"], model["group"], model["head_dim"]
    rng = np.random.default_rng(0)
    case = build(kind, p, page_size, rng)
    key = jax.random.PRNGKey(0) if not interpret else rng
    q, k, v, batch = cases.materialize(
        case, key, num_kv_heads=hkv, group=group, head_dim=head_dim, dtype=dtype, nan_fill=False
    )
    common = dict(block_q=case.block_q, sm_scale=head_dim**-0.5)
    kernel = functools.partial(body, **common, interpret=interpret)
    reference = jax.jit(functools.partial(segment_attention_reference, **common))
    out_k = kernel(q, k, v, batch)
    out_r = reference(q, k, v, batch)
    err = float(jnp.max(jnp.abs(out_k.astype(jnp.float32) - out_r.astype(jnp.float32))))
    t_k = median_seconds(lambda: jax.block_until_ready(kernel(q, k, v, batch)), iters)
    t_r = median_seconds(lambda: jax.block_until_ready(reference(q, k, v, batch)), iters)

    item = jnp.dtype(dtype).itemsize
    kv_bytes = cases.visible_pages(case) * page_size * hkv * head_dim * 2 * item
    io_bytes = 2 * int(sum(s.q_len for s in case.specs)) * hkv * group * head_dim * item
    flops = 4 * head_dim * hkv * group * cases.attended_pairs(case)
    gbps = (kv_bytes + io_bytes) / t_k / 1e9
    tflops = flops / t_k / 1e12
    peak_bw, peak_tf = peaks
    return dict(
        kind=kind, **p, page_size=page_size, dtype=jnp.dtype(dtype).name,
        kernel_ms=t_k * 1e3, reference_ms=t_r * 1e3, speedup=t_r / t_k, max_abs_err=err,
        hbm_gbps=gbps, tflops=tflops,
        hbm_frac=gbps / peak_bw if peak_bw else None,
        flops_frac=tflops / peak_tf if peak_tf else None,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    impl, _ = resolve_backend("auto")
    dev = jax.devices()[0]
    if impl == "reference":  # CPU: one small shape, GPU body interpreted
        out = args.out or RESULTS / "kernels_cpu_smoke.json"
        model = SMOKE_MODEL
        row = run_one("decode", dict(batch=2, context=256, drop=0.5), body=segment_attention_gpu,
                      page_size=16, dtype=jnp.float32, iters=1, peaks=(None, None),
                      model=model, interpret=True)
        rows = [row]
        ok = row["max_abs_err"] < 1e-5
        summary = (f"kernels smoke (cpu, interpret): max_abs_err={row['max_abs_err']:.2e} "
                   f"{'OK' if ok else 'MISMATCH'}")
    else:
        out = args.out or RESULTS / "kernels.json"
        model = MODEL
        body = segment_attention_gpu if impl == "gpu" else segment_attention_tpu
        page_size = 16 if impl == "gpu" else 128
        peaks = device_peaks(dev.device_kind)
        rows = []
        for kind, p in shapes(args.quick):
            row = run_one(kind, p, body=body, page_size=page_size, dtype=jnp.bfloat16,
                          iters=args.iters, peaks=peaks)
            rows.append(row)
            frac = f"{row['hbm_frac']:.0%}" if row["hbm_frac"] else "?"
            print(f"{kind:8s} b={p['batch']:<3d} ctx={p['context']:<6d} drop={p['drop']:.0%} "
                  f"kernel {row['kernel_ms']:8.3f} ms  ref {row['reference_ms']:9.3f} ms  "
                  f"x{row['speedup']:6.1f}  {row['hbm_gbps']:7.0f} GB/s ({frac})  "
                  f"{row['tflops']:6.1f} TF/s  err {row['max_abs_err']:.1e}", flush=True)
        ok = all(r["max_abs_err"] < 2e-2 for r in rows)
        dec = [r for r in rows if r["kind"] == "decode" and r["hbm_frac"] is not None]
        best = max((r["hbm_frac"] for r in dec), default=None)
        speed = statistics.geometric_mean([r["speedup"] for r in rows])
        summary = (f"kernels ({dev.device_kind}, {impl}): {len(rows)} shapes, geomean speedup "
                   f"vs reference x{speed:.1f}, best decode HBM "
                   f"{'n/a' if best is None else f'{best:.0%}'} of peak, "
                   f"{'all match' if ok else 'MISMATCH'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=dev.device_kind, platform=dev.platform, impl=impl, jax=jax.__version__,
                **model)
    out.write_text(json.dumps(dict(meta=meta, results=rows, summary=summary), indent=1))
    print(summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
