"""Host cost against history length (issue 35): does a turn cost what is new, and a decode step
what is still attended?

    python bench/host.py [--histories 2048 8192 32768 131072] [--repeats 15] [--out PATH]

A ``tiny`` server (``--context-length`` and pool sized for the longest history, page size 16)
answers over HTTP ``/generate`` with token ids (no tokenizer in the way):

* **cached request**: a history of ``H`` random tokens in 512-token segments is sent once
  (unmeasured: it fills the cache), then ``--repeats`` requests each append one fresh
  one-token segment and generate one token; the figure is the median client-side latency.
  The same again with a drop of the first 75% of the history's segments at its last
  boundary (the op is part of every request, as an agent resends it). Every history stays
  cached and they take turns, a request each a round in a shuffled order, so that each ratio
  compares figures taken under the same conditions (this shared host's speed drifts by 20%
  over minutes, and a request after a long one finds colder caches).
* **decode**: 64 greedy tokens streamed after a cached prompt, per-token time = (last token -
  first token) / 63, median over repeats, the two taking turns: a 32K history with 75%
  dropped (8K active) against an 8K history with nothing dropped (the same active tokens).
* **host stages**, in process on the same request bodies, with an :class:`Engine` of the
  same configuration whose cache holds the history: ``parse`` (the JSON body as the
  server reads it: segments sent before from ``SegmentMemo``, the rest by
  ``protocol.parse_json_body``), ``validate`` (``protocol.parse_generate``: types, token
  ranges, the op history), ``prepare`` (``Engine.prepare``: admission, timeline, radix
  keys; the API runs it in a worker thread), and of the engine step that admits the
  request: ``match`` (the radix tree), ``plan`` (the rest of ``Planner.plan``) and ``pack``
  (``Executor.run`` without the forward: padded arrays, segment batch, transfers). The
  forward itself runs asynchronously and is not counted.

Bodies are encoded once, before timing: what an agent spends serialising its own request is
not the server's work.

Results go to bench/results/host.json; the last line printed is

    host: cached request 32K/2K history X.XXx time, decode with 75% dropped Y.YYx of the
    same active tokens undropped
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
import numpy as np
from common import git_head

from akv_jax.agent.launch import LocalServer
from akv_jax.serving import protocol
from akv_jax.serving.engine import Engine
from akv_jax.serving.main import with_context_length
from akv_jax.serving.segment_memo import SegmentMemo
from akv_jax.serving.types import GenerateRequest
from converters.loading import load_model

SEGMENT = 512
VOCAB = 500  # the tiny model's byte ids (its special ids left out)
DECODE_NEW = 64


def history(rng: np.random.Generator, n: int) -> list[list[int]]:
    ids = rng.integers(0, VOCAB, size=n).tolist()
    return [ids[i:i + SEGMENT] for i in range(0, n, SEGMENT)]


def dropped(segs: list[list[int]], fraction: float) -> dict:
    """A drop of the first ``fraction`` of the segments (not the first: a system prompt)
    at the history's last boundary."""
    k = int(len(segs) * fraction)
    return {"drop": {str(len(segs) - 1): list(range(1, k + 1))}} if k else {}


def body(segs: list[list[int]], cache: dict, new: int, stream: bool = False) -> dict:
    return {"input_ids": segs, "cache": cache, "stream": stream,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}


def encoded(b: dict) -> bytes:
    return json.dumps(b).encode()


def timed(client: httpx.Client, raw: bytes) -> float:
    t0 = time.perf_counter()
    r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    r.raise_for_status()
    return time.perf_counter() - t0


def cached_requests(client: httpx.Client, cases: list[tuple[list[list[int]], dict]],
                    repeats: int, rng: np.random.Generator) -> list[float]:
    """Median latency of each case's cached one-token request: each history is sent once
    (filling the cache), then the cases take turns, one request each a round, so that every
    case meets the same machine (a shared host's speed drifts over minutes)."""
    for segs, cache in cases:
        timed(client, encoded(body(segs, cache, 1)))
    raws = [[encoded(body([*segs, [int(rng.integers(0, VOCAB))]], cache, 1))
             for _ in range(repeats)] for segs, cache in cases]
    times: list[list[float]] = [[] for _ in cases]
    for i in range(repeats):
        # In a new order each round: a request after a long one finds colder caches.
        for c in rng.permutation(len(cases)).tolist():
            times[c].append(timed(client, raws[c][i]))
    return [statistics.median(t) for t in times]


def decode_stream(client: httpx.Client, segs: list[list[int]], cache: dict) -> float:
    """Per-token time of one stream of DECODE_NEW greedy tokens after a cached prompt."""
    stamps = []
    with client.stream("POST", "/generate", json=body(segs, cache, DECODE_NEW, True)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def decode_per_token(client: httpx.Client, cases: list[tuple[list[list[int]], dict]],
                     repeats: int) -> list[float]:
    """Median per-token decode time of each case, the cases taking turns."""
    for segs, cache in cases:
        timed(client, encoded(body(segs, cache, 1)))
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(repeats):
        for c, (segs, cache) in enumerate(cases):
            times[c].append(decode_stream(client, segs, cache))
    return [statistics.median(t) for t in times]


class StageTimer:
    """Wraps methods so that each call's time is added to a named stage."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        timer = self

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, wrapped)


def in_process_engine(ctx: int) -> tuple[Engine, StageTimer]:
    model = with_context_length(load_model("tiny", "float32"), ctx, True)
    eng = Engine(model, max_total_tokens=2 * ctx, page_size=16)
    timer = StageTimer()
    timer.wrap(eng.cache, "match", "match")
    timer.wrap(eng.planner, "plan", "plan")
    timer.wrap(eng.executor, "run", "pack")
    timer.wrap(eng.executor.prefill, "forward", "forward")
    return eng, timer


def run_to_end(eng: Engine, raw: bytes, limits: protocol.Limits) -> None:
    inp = protocol.parse_generate(protocol.parse_json_body(raw, limits), limits,
                                  eng.cfg.vocab_size)
    eng.add_request(GenerateRequest("fill", inp.segments, inp.history, inp.sampling))
    while eng.has_work():
        eng.step()


def host_stages(eng: Engine, timer: StageTimer, segs: list[list[int]], cache: dict,
                repeats: int, rng: np.random.Generator) -> dict[str, float]:
    limits = protocol.Limits(max_body_bytes=1 << 30)
    memo = SegmentMemo(eng.cfg.vocab_size)  # the server's, as its event loop keeps it
    first = encoded(body(segs, cache, 1))
    memo.split(first)
    run_to_end(eng, first, limits)
    stages: dict[str, list[float]] = {}
    for i in range(repeats):
        raw = encoded(body([*segs, [int(rng.integers(0, VOCAB))]], cache, 1))
        t0 = time.perf_counter()
        rest, ids = memo.split(raw)  # what protocol.parse_generate_bytes does
        parsed = protocol.parse_json_body(rest, limits)
        parsed["input_ids"] = ids
        t1 = time.perf_counter()
        inp = protocol.parse_generate(parsed, limits, eng.cfg.vocab_size)
        t2 = time.perf_counter()
        req = eng.prepare(GenerateRequest(f"r{i}", inp.segments, inp.history, inp.sampling))
        t3 = time.perf_counter()
        eng.add_request(req)
        timer.seconds = {}
        eng.step()  # admits and plans it, dispatches its forward
        while eng.has_work():
            eng.step()
        got = {"parse": t1 - t0, "validate": t2 - t1, "prepare": t3 - t2,
               "match": timer.seconds["match"],
               "plan": timer.seconds["plan"] - timer.seconds["match"],
               "pack": timer.seconds["pack"] - timer.seconds["forward"]}
        for k, v in got.items():
            stages.setdefault(k, []).append(v)
    eng.flush_cache()
    return {k: statistics.median(v) for k, v in stages.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--histories", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="bench/results/host.json")
    args = ap.parse_args(argv)
    longest = max(args.histories)
    ctx = longest + 4096
    rng = np.random.default_rng(0)
    server = ["--model-path", "tiny", "--context-length", str(ctx),
              "--max-total-tokens", str(2 * ctx), "--page-size", "16"]
    t_start = time.perf_counter()
    with LocalServer(server) as srv, httpx.Client(base_url=srv.url, timeout=600) as client:
        cases, rows = [], []
        for h in args.histories:
            segs = history(rng, h)
            rows.append({"history": h, "segments": len(segs)})
            cases += [(segs, {}), (segs, dropped(segs, 0.75))]
        medians = cached_requests(client, cases, args.repeats, rng)
        for i, row in enumerate(rows):
            row["cached_s"], row["cached_dropped_s"] = medians[2 * i], medians[2 * i + 1]
        client.post("/flush_cache")
        full = history(rng, 8192)
        long = history(rng, 32768)
        undropped, with_drop = decode_per_token(
            client, [(full, {}), (long, dropped(long, 0.75))], args.repeats)
        client.post("/flush_cache")
    # The stages, once the server is gone (it would compete for the two cores).
    eng, timer = in_process_engine(ctx)
    for row in rows:
        segs = history(np.random.default_rng(row["history"]), row["history"])
        row["host_stages_s"] = host_stages(eng, timer, segs, {}, args.repeats, rng)
        row["host_stages_dropped_s"] = host_stages(eng, timer, segs, dropped(segs, 0.75),
                                                   args.repeats, rng)
        print(f"history {row['history']:>7}: cached request {row['cached_s'] * 1e3:7.1f} ms, "
              f"75% dropped {row['cached_dropped_s'] * 1e3:7.1f} ms; stages "
              + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in row["host_stages_s"].items())
              + " ms", flush=True)
    by_h = {r["history"]: r for r in rows}
    cached_ratio = (by_h[32768]["cached_s"] / by_h[2048]["cached_s"]
                    if 32768 in by_h and 2048 in by_h else float("nan"))
    decode_ratio = with_drop / undropped
    result = {
        "what": "host cost against history length, tiny model over HTTP /generate",
        "command": "python bench/host.py " + " ".join(argv or []),
        "git_head": git_head(),
        "server_args": server,
        "repeats": args.repeats,
        "cached": rows,
        "decode_per_token_s": {"8K_undropped": undropped, "32K_75pct_dropped": with_drop},
        "ratios": {"cached_32K_over_2K": cached_ratio, "decode_dropped_over_undropped":
                   decode_ratio},
        "targets": {"cached_32K_over_2K": 2.0, "decode_dropped_over_undropped": 1.15},
        "wall_s": time.perf_counter() - t_start,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"decode per token: 8K undropped {undropped * 1e3:.2f} ms, 32K with 75% dropped "
          f"{with_drop * 1e3:.2f} ms")
    print(f"host: cached request 32K/2K history {cached_ratio:.2f}x time, decode with 75% "
          f"dropped {decode_ratio:.2f}x of the same active tokens undropped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
