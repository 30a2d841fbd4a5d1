"""Constrained (grammar-masked) decoding against free decoding, over HTTP, the same prompts.

    python bench/structured.py [--quick] [--model tiny-qwen3-moe-bpe] [--batches 1 8]
                               [--requests 16] [--max-tokens 128] [--repeats 5]
                               [--mask-steps 400] [--out PATH]

A local server (:class:`akv_jax.agent.launch.LocalServer`: ``--model-path MODEL
--max-total-tokens 16384 --page-size 16 --reasoning-budget 0``; default the random
Qwen3-MoE over Qwen3's real 151,936-id vocabulary, ``tiny-gpt-oss-bpe`` for o200k_harmony)
answers ``--requests`` chat requests (distinct seeded user messages, the same two tools
with bounded strings and integers, so a random model's call ends), temperature 0, with
``--batches`` concurrency (1: one after another; 8: eight in flight at a time, from
threads):

* **constrained**: ``tool_choice`` "required" (a call of either tool, the grammar of
  :meth:`akv_jax.formats.constraint.GrammarCompiler.tool_calls`), ``max_tokens``
  ``--max-tokens``: decoding stops when the grammar completes. The tokens the grammar forces
  (jump-forward, fed in one decode pass) are output tokens, since the client receives them;
  their share is reported too (a forced token is the one whose logprob is null).
* **free**: the same prompts (the same tools in the prompt, ``tool_choice`` "auto", which
  parses but constrains nothing), each with ``max_tokens`` = the completion tokens its
  constrained twin produced in an unmeasured warm-up run and ``ignore_eos``: every free
  request generates exactly as many tokens as its constrained twin, so the two runs hold
  the same batch occupancy over time and differ only in the grammar.

Output tokens/s = completion tokens summed / wall time of the run (the first request sent
to the last answer; prefill included, alike for both). Every run starts from a flushed
prefix cache; each batch size is run twice unmeasured per mode first (compiles its step
shapes, gives the free lengths); the repeats alternate which mode goes first (ABBA...) so
load drifts of this shared machine hit both alike. The figure is the median over repeats,
the ratio constrained / free of the medians (>= 0.8x is the issue's target at batch 8).

The model is random, which is a worst case for the constrained side: its greedy token is
rarely one the grammar allows, so nearly every sampled constrained step needs the masked
argmax, which the engine runs on the device behind the forward
(:mod:`akv_jax.serving.constrained_rows`); a trained model's greedy token usually is
allowed and comes with the step's greedy summary.

Host-side mask cost, measured offline (no server) with the same grammar on the same
vocabulary: a :class:`~akv_jax.formats.constraint.TokenConstraint` is driven over
``--mask-steps`` sampled steps (forced tokens taken and advanced, otherwise
:meth:`~akv_jax.formats.constraint.TokenConstraint.allowed` timed, the argmax of a random
logits row under the mask advanced, a fresh constraint when the grammar completes); reported
per sampled step as mean and median microseconds (and advance()'s, and the mask time spread
over every output token, forced ones included). The engine computes the masks while the
step's forward runs, so part of this is hidden behind the device.

Results go to bench/results/structured.json; the last line printed is

    structured: constrained X.XXx of free output tokens/s at batch 8, mask Y us/token

(Y: mean allowed() microseconds per sampled step).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from common import git_head

from akv_jax.agent import launch

HERE = Path(__file__).resolve().parent
FAMILY = {"tiny-qwen3-moe-bpe": "qwen3", "tiny-gpt-oss-bpe": "harmony"}

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
LOOKUP = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather by city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "lookup", "description": "Search notes.",
                                      "parameters": LOOKUP}},
]
CITIES = ["Paris", "Lima", "Oslo", "Hanoi", "Quito", "Accra", "Perth", "Riga", "Cork", "Baku",
          "Kyoto", "Tunis", "Bern", "Dakar", "Porto", "Split"]


def messages_for(n: int, seed: int) -> list[list[dict]]:
    """``n`` distinct two-message chats (seeded)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        city = CITIES[i % len(CITIES)]
        days = int(rng.integers(1, 8))
        extra = " ".join(rng.choice(["please", "quickly", "also", "rain", "wind", "sun"],
                                    int(rng.integers(0, 6))))
        out.append([
            {"role": "system", "content": "You are a weather agent."},
            {"role": "user", "content": f"What is the weather in {city} for {days} days? {extra}"},
        ])
    return out


def body(msgs: list[dict], mode: str, max_tokens: int, model: str) -> dict:
    b = {"model": model, "messages": msgs, "tools": TOOLS, "temperature": 0,
         "max_tokens": max_tokens, "logprobs": True}
    if mode == "constrained":
        b["tool_choice"] = "required"
    else:
        b["tool_choice"] = "auto"
        b["ignore_eos"] = True
    return b


def run_batch(client: httpx.Client, url: str, prompts: list[list[dict]], mode: str,
              max_tokens: list[int], concurrency: int, model: str) -> dict:
    """One measured run: every prompt once, ``concurrency`` at a time; from a flushed cache."""
    launch.flush(url)
    results: list[dict | None] = [None] * len(prompts)

    def one(i: int) -> None:
        r = client.post("/v1/chat/completions", json=body(prompts[i], mode, max_tokens[i], model))
        if r.status_code != 200:
            raise RuntimeError(f"{mode} request {i}: HTTP {r.status_code}: {r.text[:400]}")
        j = r.json()
        ch = j["choices"][0]
        lps = [t["logprob"] for t in (ch.get("logprobs") or {}).get("content") or []]
        results[i] = {
            "completion_tokens": j["usage"]["completion_tokens"],
            "prompt_tokens": j["usage"]["prompt_tokens"],
            "forced_tokens": sum(lp is None for lp in lps),
            "logprob_tokens": len(lps),
            "finish_reason": ch["finish_reason"],
            "tool_calls": len(ch["message"].get("tool_calls") or []),
        }

    t0 = time.perf_counter()
    if concurrency == 1:
        for i in range(len(prompts)):
            one(i)
    else:
        with ThreadPoolExecutor(concurrency) as ex:
            for f in [ex.submit(one, i) for i in range(len(prompts))]:
                f.result()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    tokens = sum(r["completion_tokens"] for r in done)
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "tok_s": tokens / wall,
        "forced_fraction": sum(r["forced_tokens"] for r in done) / max(1, tokens),
        "per_request": done,
    }


def mask_cost(model: str, steps: int, max_tokens: int, seed: int) -> dict:
    """allowed() (and advance()) timings of the server's grammar on the model's vocabulary."""
    from akv_jax.formats.constraint import GrammarCompiler
    from converters.loading import load_model

    m = load_model(model)
    width = m.cfg.vocab_size  # the server's logits width (main.py: vocab_size=model.cfg...)
    t = time.perf_counter()
    compiler = GrammarCompiler(m.tokenizer, width, FAMILY[model])
    build_s = time.perf_counter() - t
    rng = np.random.default_rng(seed)
    fill: list[float] = []
    adv: list[float] = []
    forced_n = total = docs = 0
    # parallel and reasoning budget as the server makes them for these requests:
    # parallel_tool_calls defaults to true; budget min(--reasoning-budget 0, max_tokens // 2).
    t = time.perf_counter()
    compiler.tool_calls(TOOLS, parallel=True, reasoning_budget=0)
    compile_s = time.perf_counter() - t
    while len(fill) < steps:
        c = compiler.tool_calls(TOOLS, parallel=True, reasoning_budget=0)
        docs += 1
        n = 0
        while not c.finished and n < max_tokens:
            f = c.forced()
            if f:
                for tok in f:
                    c.advance(tok)
                forced_n += len(f)
                n += len(f)
                continue
            logits = rng.standard_normal(width, dtype=np.float32)
            t0 = time.perf_counter()
            allowed = c.allowed()
            t1 = time.perf_counter()
            tok = int(np.argmax(np.where(allowed, logits, -np.inf)))
            t2 = time.perf_counter()
            c.advance(tok)
            t3 = time.perf_counter()
            fill.append(t1 - t0)
            adv.append(t3 - t2)
            n += 1
        total += n
    us = [1e6 * x for x in fill]
    return {
        "vocab_width": width,
        "family": FAMILY[model],
        "grammar_compiler_build_s": build_s,
        "first_grammar_compile_s": compile_s,
        "sampled_steps": len(fill),
        "documents": docs,
        "output_tokens": total,
        "forced_fraction": forced_n / max(1, total),
        "allowed_us_mean": statistics.mean(us),
        "allowed_us_median": statistics.median(us),
        "allowed_us_p90": float(np.percentile(us, 90)),
        "allowed_us_max": max(us),
        "advance_us_mean": 1e6 * statistics.mean(adv),
        "advance_us_median": 1e6 * statistics.median(adv),
        "allowed_us_per_output_token": 1e6 * sum(fill) / max(1, total),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-qwen3-moe-bpe", choices=sorted(FAMILY))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=16, help="requests per run")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mask-steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="8 requests a run, 2 repeats, 200 mask steps")
    ap.add_argument("--out", default=str(HERE / "results" / "structured.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.repeats, args.mask_steps = 8, 2, 200
    t_start = time.perf_counter()
    load_before = os.getloadavg()

    mask = mask_cost(args.model, args.mask_steps, args.max_tokens, args.seed)
    print(f"mask: allowed() {mask['allowed_us_mean']:.0f} us mean, "
          f"{mask['allowed_us_median']:.0f} us median per sampled step "
          f"({mask['sampled_steps']} steps, width {mask['vocab_width']}); advance() "
          f"{mask['advance_us_mean']:.0f} us mean", file=sys.stderr, flush=True)

    server_args = ["--model-path", args.model, "--max-total-tokens", "16384",
                   "--page-size", "16", "--reasoning-budget", "0",
                   "--max-running-requests", str(max(16, *args.batches))]
    server = launch.LocalServer(server_args)
    print(f"server {server.url} ready after {time.perf_counter() - t_start:.0f} s",
          file=sys.stderr, flush=True)
    results: dict[str, dict] = {}
    try:
        with server.client(timeout=600) as client:
            prompts = messages_for(args.requests, args.seed)
            cap = [args.max_tokens] * len(prompts)
            for b in args.batches:
                # Unmeasured: compiles this batch's step shapes (jump-forward rows pad to
                # token buckets a free decode never meets; at batch 8 which rows share a
                # step depends on arrival timing, hence twice) and gives the free lengths.
                for _ in range(2):
                    warm_c = run_batch(client, server.url, prompts, "constrained", cap, b,
                                       args.model)
                    lengths = [r["completion_tokens"] for r in warm_c["per_request"]]
                    run_batch(client, server.url, prompts, "free", lengths, b, args.model)
                runs: dict[str, list[dict]] = {"constrained": [], "free": []}
                for rep in range(args.repeats):
                    order = ("constrained", "free") if rep % 2 == 0 else ("free", "constrained")
                    for mode in order:
                        mt = cap if mode == "constrained" else lengths
                        r = run_batch(client, server.url, prompts, mode, mt, b, args.model)
                        runs[mode].append(r)
                        print(f"batch {b} {mode}: {r['tok_s']:.1f} tok/s "
                              f"({r['completion_tokens']} tokens, {r['wall_s']:.2f} s, "
                              f"forced {r['forced_fraction']:.0%})", file=sys.stderr, flush=True)
                res: dict = {"warmup_constrained_lengths": lengths}
                for mode, rs in runs.items():
                    res[mode] = {
                        "tok_s": statistics.median(r["tok_s"] for r in rs),
                        "tok_s_runs": [r["tok_s"] for r in rs],
                        "wall_s_runs": [r["wall_s"] for r in rs],
                        "completion_tokens_runs": [r["completion_tokens"] for r in rs],
                        "forced_fraction": statistics.median(r["forced_fraction"] for r in rs),
                        "per_request_last_run": rs[-1]["per_request"],
                    }
                c_lengths = [[x["completion_tokens"] for x in r["per_request"]]
                             for r in runs["constrained"]]
                res["constrained_lengths_equal_warmup"] = all(x == lengths for x in c_lengths)
                res["ratio"] = res["constrained"]["tok_s"] / res["free"]["tok_s"]
                results[str(b)] = res
    finally:
        rc = server.stop()
    report = {
        "what": "constrained (tool_choice required, grammar-masked, jump-forward) vs free "
        "(same prompts and tools, tool_choice auto, ignore_eos, max_tokens = the constrained "
        "twin's length) chat completions over HTTP, temperature 0",
        "statistic": "output tokens/s = completion tokens summed / run wall time (forced "
        "tokens counted), median over repeats; ratio = constrained / free medians in this "
        "run; forced_fraction = null-logprob tokens / completion tokens (the final stop "
        "token has no logprob entry, so it is left out); mask: TokenConstraint.allowed() "
        "per sampled step, offline, random logits",
        "model": args.model,
        "server_args": server_args,
        "server_exit_code": rc,
        "batches": args.batches,
        "requests_per_run": args.requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "tools": TOOLS,
        "command": " ".join(["python", *sys.argv]),
        "git_head": git_head(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": importlib.metadata.version("jax"),
            "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "wall_s": time.perf_counter() - t_start,
        "mask": mask,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for b, r in results.items():
        print(f"batch {b}: constrained {r['constrained']['tok_s']:.1f} tok/s "
              f"(forced {r['constrained']['forced_fraction']:.0%}), free "
              f"{r['free']['tok_s']:.1f} tok/s = {r['ratio']:.2f}x")
    key = "8" if "8" in results else str(max(args.batches))
    print(f"mask allowed(): mean {mask['allowed_us_mean']:.0f} us, median "
          f"{mask['allowed_us_median']:.0f} us per sampled step")
    print(f"structured: constrained {results[key]['ratio']:.2f}x of free output tokens/s at "
          f"batch {key}, mask {mask['allowed_us_mean']:.0f} us/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
