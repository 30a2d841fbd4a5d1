"""Deviceless compiles of akv_jax for A800 / H100 / H200 and TPU v5e / v6e / v5p.

    bash scripts/aot.sh                      # builds .venv-aot (the toolchains) once
    .venv-aot/bin/python bench/aot.py        # the full matrix (~30 min on 2 cores)
    .venv-aot/bin/python bench/aot.py --ci   # the CI set: each kernel at decode bf16 and the
                                             # GPT-OSS-120B TP4 decode step, every target

Prints the target table, one row per compile (registers and spills from ptxas on GPUs,
scoped VMEM on TPUs, memory_analysis(), cost_analysis() and a roofline *estimate* of the time
on that chip), the memory plan of the paper's setup (GPT-OSS-120B, bf16, TP4 on A800s: how
many KV-pool tokens fit beside it), and writes bench/results/aot.json. Exits 1 when any
compile fails. The last line reads
``aot: K/N compiles succeed on T targets, GPT-OSS-120B TP4 bf16 fits with a KV pool of M
tokens per A800``. See akv_jax/aot/compiler.py for what each figure means.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

# Before jax starts (see akv_jax.aot.compiler.ENV): no CUDA driver check, ptxas' report logged.
from akv_jax.aot.compiler import ENV  # noqa: E402  (imports jax, but no backend starts yet)

for _k, _v in ENV.items():
    os.environ[_k] = _v

from akv_jax.aot.compiler import PAGE_SIZE, Result, check_env  # noqa: E402
from akv_jax.aot.kernel_compiles import compile_kernel, kernel_cases  # noqa: E402
from akv_jax.aot.step_compiles import compile_step, fits, kv_pool_tokens, step_cases  # noqa: E402
from akv_jax.aot.targets import PAPER_TARGET, TARGETS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "aot.json"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def target_table() -> list[str]:
    rows = ["| target | arch | device kind | peak bf16 TFLOP/s | HBM GB/s | HBM GB "
            "| SMs / cores |",
            "|---|---|---|---|---|---|---|"]
    for t in TARGETS.values():
        rows.append(f"| {t.name} | {t.arch} | {t.device_kind} | {t.peak_bf16_flops / 1e12:g} | "
                    f"{t.hbm_bytes_per_s / 1e9:g} | {t.memory_bytes / 1e9:.1f} | {t.cores} |")
    return rows


def result_row(r: Result) -> str:
    if not r.ok:
        return f"| {r.target} | {r.name} | FAIL | {r.error[:160]} | | | | |"
    if r.kernels:
        main = {k: v for k, v in r.kernels.items() if k.startswith("akv_")}
        regs = ", ".join(f"{v['registers']}" for v in main.values()) or "-"
        spill = sum(v["spill_stores"] + v["spill_loads"] for v in main.values())
        limits = f"regs {regs}, spill {spill} B"
    elif r.vmem:
        limits = "VMEM " + ", ".join(f"{v / 1024:.0f} KiB" for v in r.vmem.values())
    else:
        limits = "-"
    m = r.memory
    return (f"| {r.target} | {r.name} | ok {r.seconds:.0f}s | {limits} | "
            f"{_gb(m.get('argument', 0))} | "
            f"{_gb(m.get('temp', 0))} | {r.flops / 1e9:.1f} / {_gb(r.bytes)} ({r.cost_source}) | "
            f"{r.estimate_s * 1e3:.3f} |")


def _write(args: argparse.Namespace, results: list, skipped: list, t0: float,
           plan: dict | None = None) -> None:
    """The JSON, rewritten after every compile (a long run leaves its rows so far)."""
    payload = dict(
        targets={k: dataclasses.asdict(v) for k, v in TARGETS.items() if k in args.targets},
        results=[dataclasses.asdict(r) for r in results],
        ci=args.ci, seconds=time.perf_counter() - t0, complete=plan is not None,
        memory_plan=plan or {}, not_compiled=skipped,
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ci", action="store_true", help="the CI set only")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--only", choices=("kernels", "steps"), help="one half of the matrix")
    ap.add_argument("--steps", metavar="TEXT",
                    help="compile only the steps whose name contains TEXT "
                         "(e.g. 'GPT-OSS-120B TP4 decode')")
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    missing = check_env()
    if missing:
        print(f"aot: set {' '.join(missing)} before jax starts", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    print("\n".join(target_table()))
    print()
    print("| target | compile | result | registers, spills (GPU) / VMEM (TPU) | argument GB | "
          "temp GB | GFLOP / GB accessed | estimate ms |")
    print("|---|---|---|---|---|---|---|---|")
    results: list[Result] = []
    skipped: list[str] = []
    for name in args.targets:
        for case in kernel_cases(full=not args.ci) if args.only != "steps" else ():
            r = compile_kernel(name, case)
            results.append(r)
            print(result_row(r), flush=True)
            _write(args, results, skipped, t0)
        if args.only == "kernels":
            continue
        for case in step_cases(full=not args.ci):
            if args.ci and name != PAPER_TARGET:
                continue  # CI compiles the serving step once: the paper's setup
            if args.steps and args.steps not in case.name:
                continue
            fit, why = fits(name, case)
            if not fit:  # reported, not compiled: XLA would stop at CompileTimeHbmOom
                skipped.append(f"{name}: {case.name}: {why}")
                print(f"| {name} | {case.name} | n/a | {why} | | | | |", flush=True)
                continue
            r = compile_step(name, case)
            if r.ok and case.model == "GPT-OSS-120B":
                r.extra["fits_pool_tokens"] = kv_pool_tokens(r, TARGETS[name].memory_bytes)
            results.append(r)
            print(result_row(r), flush=True)
            _write(args, results, skipped, t0)

    plan = [r for r in results if r.ok and "fits_pool_tokens" in r.extra
            and "decode" in r.name]
    print()
    print("Memory plan (estimate from memory_analysis(); GPT-OSS-120B bf16, TP4, page size "
          f"{PAGE_SIZE}): KV pool tokens that fit per device beside weights, "
          "inputs and the decode step's temporaries")
    for r in plan:
        m = r.memory
        pool = r.extra["kv_bytes_per_token"] * r.extra["pool_tokens"]
        print(f"  {r.target}: weights+inputs {_gb(m['argument'] - pool)} GB, temp "
              f"{_gb(m['temp'])} GB, {r.extra['kv_bytes_per_token']} B/token -> "
              f"{r.extra['fits_pool_tokens']:,} tokens in {_gb(TARGETS[r.target].memory_bytes)} GB")

    ok = sum(r.ok for r in results)
    targets = len({r.target for r in results})
    paper = next((r for r in plan if r.target == PAPER_TARGET), None)
    tokens = paper.extra["fits_pool_tokens"] if paper else 0
    _write(args, results, skipped, t0, {r.target: r.extra["fits_pool_tokens"] for r in plan})
    print(f"wrote {args.json} ({time.perf_counter() - t0:.0f} s)")
    print(f"aot: {ok}/{len(results)} compiles succeed on {targets} targets, GPT-OSS-120B TP4 "
          f"bf16 fits with a KV pool of {tokens} tokens per {PAPER_TARGET}")
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
