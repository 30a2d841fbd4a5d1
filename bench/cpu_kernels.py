"""The three C++ CPU kernels against XLA's own code for the same work, at SmolLM2's shapes.

    python bench/cpu_kernels.py [--repeats 9] [--out bench/results/cpu_kernels.json]

Why this exists: the kernels are compiled with ``-march=native``, so their speed depends on
the CPU's vector unit. Written and tuned on an AVX-512 host, they ran 3-35x slower than XLA
on an AVX2 host (a 16-float vector type is no register there; session 12), and no test can
see that. This script puts each kernel beside the baseline it replaces, in the same process
and minutes, and says which vector width it was built for:

* ``gemm``: prefill's many-row projections (:func:`akv_jax.pallas.cpu_matmul.matmul`, 2,048
  rows: ``cpu_gemm.cc``) against ``jnp.dot``;
* ``few-row``: a decode step's projections (1, 4 and 8 rows: ``cpu_matmul.cc``) against
  ``jnp.dot``;
* ``attention``: one layer's causal attention over a 2,000-token prefill block by block
  (``cpu_attention.cc``) against the chunked jnp attention (:mod:`akv_jax.pallas.chunked`),
  the path ``--attention-backend auto`` takes without the kernel.

Medians of ``--repeats`` timed calls each (compiles excluded), kernel and baseline alternated.
The last line: ``cpu_kernels (ISA): gemm X.XXx, few-row X.XXx, attention X.XXx`` (geometric
means of the baseline's time over the kernel's: above 1, the kernel is faster).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import git_head, interleaved_medians

from akv_jax.kernels.cpu import matmul as cpu_matmul
from akv_jax.pallas import segment_attention_cpu as cpu_attention
from akv_jax.pallas.chunked import segment_attention_chunked
from akv_jax.pallas.metadata import SegmentSpec, build_segment_batch

HIDDEN, FFN, Q_OUT, KV_OUT = 576, 1536, 576, 192  # SmolLM2-135M's projections
PRODUCTS = [(HIDDEN, FFN), (FFN, HIDDEN), (HIDDEN, Q_OUT), (HIDDEN, KV_OUT)]


def isa() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        pass
    return "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "other"


def timed_pair(f, g, args: tuple, repeats: int) -> tuple[float, float]:
    """Medians of the times of jitted f(*args) and g(*args), alternating."""
    t = interleaved_medians({"f": lambda: f(*args).block_until_ready(),
                             "g": lambda: g(*args).block_until_ready()}, repeats)
    return t["f"], t["g"]


def bench_products(rows: int, repeats: int, rng: np.random.Generator) -> list[dict]:
    out = []
    for k, n in PRODUCTS:
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
        w = jnp.asarray(rng.standard_normal((k, n), np.float32) / math.sqrt(k))
        kern, xla = jax.jit(cpu_matmul.matmul), jax.jit(jnp.dot)
        np.testing.assert_allclose(kern(x, w), xla(x, w), rtol=1e-4, atol=1e-4)
        tk, tx = timed_pair(kern, xla, (x, w), repeats)
        flop = 2 * rows * k * n
        out.append({"rows": rows, "k": k, "n": n, "kernel_ms": tk * 1e3, "xla_ms": tx * 1e3,
                    "kernel_gflops": flop / tk / 1e9, "xla_gflops": flop / tx / 1e9,
                    "ratio": tx / tk})
        print(f"  {rows:5d} x {k:4d} -> {n:4d}: kernel {tk * 1e3:7.2f} ms "
              f"({flop / tk / 1e9:5.0f} GFLOP/s), XLA {tx * 1e3:7.2f} ms "
              f"({flop / tx / 1e9:5.0f}): {tx / tk:.2f}x", flush=True)
    return out


def bench_attention(tokens: int, repeats: int, rng: np.random.Generator) -> dict:
    hq, hkv, dh, ps, block_q = 9, 3, 64, 16, 64  # SmolLM2's heads; the engine's prefill blocks
    pages = -(-tokens // ps)
    q = jnp.asarray(rng.standard_normal((tokens, hq, dh), np.float32))
    k = jnp.asarray(rng.standard_normal((pages, ps, hkv, dh), np.float32))
    v = jnp.asarray(rng.standard_normal((pages, ps, hkv, dh), np.float32))
    seg = SegmentSpec(q_start=0, q_len=tokens, pages=list(range(pages)),
                      kv_visible=np.ones(tokens, bool), causal_pos=0)
    batch = build_segment_batch([seg], page_size=ps, block_q=block_q)
    kw = {"block_q": block_q, "sm_scale": dh ** -0.5}
    kern = jax.jit(lambda q, k, v, b: cpu_attention.segment_attention_cpu(q, k, v, b, **kw))
    jnp_path = jax.jit(lambda q, k, v, b: segment_attention_chunked(q, k, v, b, **kw))
    np.testing.assert_allclose(kern(q, k, v, batch), jnp_path(q, k, v, batch), atol=2e-5)
    tk, tj = timed_pair(kern, jnp_path, (q, k, v, batch), repeats)
    flop = 4 * tokens * tokens / 2 * dh * hq  # causal: half the score and value products
    print(f"  attention, {tokens}-token causal prefill: kernel {tk * 1e3:.1f} ms "
          f"({flop / tk / 1e9:.0f} GFLOP/s), jnp path {tj * 1e3:.1f} ms: {tj / tk:.2f}x",
          flush=True)
    return {"tokens": tokens, "kernel_ms": tk * 1e3, "jnp_ms": tj * 1e3,
            "kernel_gflops": flop / tk / 1e9, "ratio": tj / tk}


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=2000, help="attention's prefill length")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent / "results" / "cpu_kernels.json")
    args = ap.parse_args(argv)
    if jax.default_backend() != "cpu" or not (cpu_matmul.available()
                                              and cpu_attention.available()):
        print("error: needs the CPU backend with the C++ kernels built", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    target = isa()
    print(f"CPU vector unit: {target}; load average {os.getloadavg()[0]:.2f}", flush=True)
    print("gemm (prefill projections):", flush=True)
    gemm = bench_products(2048, args.repeats, rng)
    print("few-row (decode projections):", flush=True)
    few = [r for rows in (1, 4, 8) for r in bench_products(rows, args.repeats, rng)]
    print("attention:", flush=True)
    att = bench_attention(args.tokens, args.repeats, rng)
    summary = {"gemm": geomean([r["ratio"] for r in gemm]),
               "few_row": geomean([r["ratio"] for r in few]), "attention": att["ratio"]}
    result = {"git": git_head(), "isa": target, "repeats": args.repeats,
              "load_average": os.getloadavg()[0], "gemm": gemm, "few_row": few,
              "attention": att, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps(runs + [result], indent=1) + "\n")
    print(f"cpu_kernels ({target}): gemm {summary['gemm']:.2f}x, few-row "
          f"{summary['few_row']:.2f}x, attention {summary['attention']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
