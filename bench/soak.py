"""Soak run: many concurrent clients, faults and a server crash, with every answer checked.

    python bench/soak.py                 # 3 minutes of load, 64 clients (~3.5 min in all)
    python bench/soak.py --minutes 1     # the CI size (tests/test_soak.py)
    python bench/soak.py --out bench/results/soak.json

What runs. A tiny-model server (``--model-path tiny``, a 1,024-token KV pool so that the cache
evicts and restores all the time, 127.0.0.1, ``--port 0``) with a persistent compile cache in a
fresh temporary folder (``--compile-cache-dir``). Everything is loopback and every loop is
bounded in count and in time.

1. Reference answers. A fixed-seed set of histories like ``random_requests`` in
   tests/engine_cases.py (3-7 segments of random token ids, drops of middle segments and
   at the last boundary, repositions, multi-turn extensions of earlier histories, half of which
   carry the parent's answer as the next assistant segment). Each is sent alone, right after a
   ``POST /flush_cache``: greedy, ``ignore_eos``, ``return_logprob``. By DESIGN §2 that answer
   is the only right one, whatever the server holds later.
2. Load, ``--minutes`` long: ``--clients`` asyncio clients (one httpx pool) draw actions:
   a history's request (then, half the time, its extensions in turn, as an agent would), a
   stream (``"stream": true``) closed after a few tokens (a quarter are read to the end),
   malformed JSON (expect 400), an invalid op history or token id (expect 400), a body whose
   declared length is over the server's 64 MiB limit (expect 413; 400 is counted apart as
   ``oversize_400``), ``POST /flush_cache`` (200, or 409 while requests run). Every 200 answer
   (tokens of a cut stream included) is compared with its reference: tokens equal, log-probs
   bit for bit (float32; docs/design.md §4.1).
3. Crash. Half-way through, the server gets SIGKILL and is started again with the same flags
   on the same port (so clients keep their URL). Clients see connection errors until it is
   back and retry; such errors between the kill and a few seconds after the restart is ready
   are the expected ``restart_gap`` class, anywhere else they are unexpected. The restart must
   load its programs from the persistent compile cache: the server runs with
   ``JAX_DEBUG_LOG_MODULES=jax._src.compiler``, and the restart must log at least one
   "Persistent compilation cache hit" for an entry written before the kill, with none of those
   entries gone.
4. End. Clients stop at the deadline; once the server is idle, a flush must leave 0 KV pages
   in use (``akv_kv_pool_used_pages`` in /metrics).

Printed: requests answered (HTTP responses received, all statuses), errors by class (expected
and unexpected), mismatches (requests saved to ``<out>-mismatches.json``), p50/p99 latency of
the checked non-stream requests (also apart before the kill and after the restart), pages in
use after the final flush, the server's RSS (VmRSS, sampled every 5 s) at start and end of each
process and over the second half of each process's samples (where a leak would keep climbing
and compile caches have levelled off). The JSON goes to ``--out`` if given, else to a temporary
file (its path is printed). The last line is
``soak: N requests, M mismatches, L leaked pages, restart ok`` and the exit status is non-zero
on a mismatch, a leaked page, an unexpected error or a failed restart.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from common import git_head, rss_mib

from akv_jax.agent.launch import LocalServer, metrics
from akv_jax.cache.ops import add_random_ops

VOCAB = 512  # tiny_config's vocabulary
BODY_LIMIT = 64 << 20  # protocol.Limits.max_body_bytes, the server default
MAX_PROMPT_TOKENS = 320  # histories longer than this start afresh (keeps requests pool-sized)
RESTART_GRACE_S = 5.0  # after the restart is ready, pooled connections may still fail once
HIT = re.compile(r"Persistent compilation cache hit for '[^']*' with key '([^']+)'")
EXPECTED = {
    "invalid_400", "malformed_400", "oversize_413", "oversize_400", "flush_409", "stream_cut",
    "restart_gap",
}
OK = {"generate_200", "stream_200", "flush_200"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="length of the load phase")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--histories", type=int, default=48, help="distinct reference requests")
    p.add_argument("--max-total-tokens", type=int, default=1024, help="server KV pool")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="per HTTP request (s)")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default: a temporary file, printed)")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- histories


@dataclasses.dataclass
class History:
    """One valid request and its reference answer (computed alone after a flush)."""

    index: int
    segments: list[list[int]]
    cache: dict[str, Any]
    max_new_tokens: int
    parent: int | None = None
    children: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)

    def body(self, stream: bool = False) -> dict[str, Any]:
        return {
            "input_ids": self.segments,
            "cache": self.cache,
            "sampling_params": {"max_new_tokens": self.max_new_tokens, "ignore_eos": True},
            "return_logprob": True,
            "stream": stream,
        }


def next_history(rng: np.random.Generator, pool: list[History]) -> History:
    """A fresh history or an extension of one in ``pool`` (as ``random_requests`` in
    tests/engine_cases.py, plus the parent's answer as an assistant segment)."""
    parent = None
    segs: list[list[int]] = []
    cache: dict[str, Any] = {"drop": {}, "reposition": []}
    new: list[list[int]] = []
    if pool and rng.random() < 0.4:
        parent = pool[int(rng.integers(len(pool)))]
        if sum(map(len, parent.segments)) < MAX_PROMPT_TOKENS - 80:
            segs = [list(s) for s in parent.segments]
            cache = {"drop": dict(parent.cache["drop"]),
                     "reposition": list(parent.cache["reposition"])}
            if rng.random() < 0.5:
                new.append(list(parent.tokens))  # the answer becomes the next turn's segment
        else:
            parent = None
    dropped = {i for v in cache["drop"].values() for i in v}
    new += [rng.integers(0, VOCAB, size=int(rng.integers(1, 20))).tolist()
            for _ in range(int(rng.integers(1, 5)))]
    for seg in new:
        segs.append(seg)
        s = len(segs) - 1
        add_random_ops(rng, cache, s, dropped, p_drop=0.2, p_repos=0.3)
    h = History(len(pool), segs, cache, int(rng.integers(4, 9)),
                None if parent is None else parent.index)
    if parent is not None:
        parent.children.append(h.index)
    return h


def invalid_body(rng: np.random.Generator, h: History) -> dict[str, Any]:
    """``h``'s request broken in one of the ways the API must refuse with 400."""
    body = h.body()
    n = len(h.segments)
    segs = [list(s) for s in h.segments]
    kind = int(rng.integers(8))
    if kind == 0:
        body["cache"] = {"drop": {str(n): [0]}}  # boundary past the last segment
    elif kind == 1:
        body["cache"] = {"drop": {"0": [min(1, n)]}}  # dropped before it exists (or past the end)
    elif kind == 2:
        body["cache"] = {"drop": {"0": [0], str(n - 1): [0]}} if n > 1 else {"drop": {"0": [5]}}
    elif kind == 3:
        body["cache"] = {"reposition": [n - 1, n - 1]}  # duplicate boundary
    elif kind == 4:
        body["cache"] = {"evict": [0]}  # unknown operation
    elif kind == 5:
        segs[-1][0] = VOCAB + int(rng.integers(1000))  # outside the vocabulary
        body["input_ids"] = segs
    elif kind == 6:
        body["input_ids"] = [*segs, []]  # empty segment
    else:
        body["sampling_params"] = {"max_new_tokens": 0}
    return body


MALFORMED = (b'{"input_ids": [[1, 2, 3]', b"[1, 2, 3]", b'{"input_ids": NaN}', b"\xff\xfe{}",
             b"", b"null", b'{"input_ids": [[1, 2]], }')


# --------------------------------------------------------------------------- bookkeeping


@dataclasses.dataclass
class Stats:
    classes: Counter = dataclasses.field(default_factory=Counter)
    examples: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    answered: int = 0  # HTTP responses received (any status)
    latencies: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (start, s)
    mismatches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    compared_tokens: int = 0
    after_restart_checked: int = 0

    def note(self, cls: str, detail: str = "") -> None:
        self.classes[cls] += 1
        ex = self.examples.setdefault(cls, [])
        if detail and len(ex) < 3:
            ex.append(detail[:300])


class Restart:
    """The window in which connection errors are expected (kill .. ready + grace)."""

    def __init__(self) -> None:
        self.killed_at: float | None = None
        self.ready_at: float | None = None

    def in_window(self, t: float) -> bool:
        if self.killed_at is None or t < self.killed_at:
            return False
        return self.ready_at is None or t <= self.ready_at + RESTART_GRACE_S

    def after(self, t: float) -> bool:
        return self.ready_at is not None and t > self.ready_at


def compare(stats: Stats, h: History, tokens: list[int], lps: list[float], how: str,
            restart: Restart, t0: float) -> None:
    """Count a mismatch unless ``tokens``/``lps`` equal the reference (or its prefix)."""
    n = len(tokens)
    ref_t, ref_l = h.tokens[:n], h.logprobs[:n]
    ok = n <= len(h.tokens) and tokens == ref_t and len(lps) == n
    if ok and n:  # JSON carries a float32 exactly: compare its bits
        ok = np.array_equal(np.asarray(lps, np.float32).view(np.int32),
                            np.asarray(ref_l, np.float32).view(np.int32))
    stats.compared_tokens += n
    if restart.after(t0):
        stats.after_restart_checked += 1
    if not ok:
        stats.mismatches.append({
            "history": h.index, "how": how, "after_restart": restart.after(t0),
            "request": h.body(), "expected_tokens": ref_t, "expected_logprobs": ref_l,
            "tokens": tokens, "logprobs": lps,
        })


# --------------------------------------------------------------------------- HTTP actions


async def reference_answers(url: str, pool: list[History], timeout: float) -> None:
    """Each history alone on an empty cache: flush, then the request."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        for h in pool:
            await flush(client, 30.0)
            r = await client.post("/generate", json=h.body())
            if r.status_code != 200:
                raise RuntimeError(f"reference request {h.index} failed: {r.status_code} "
                                   f"{r.text[:300]}")
            out = r.json()
            h.tokens, h.logprobs = out["output_ids"], out["output_token_logprobs"]


async def flush(client: httpx.AsyncClient, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        r = await client.post("/flush_cache")
        if r.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"flush_cache kept failing: {r.status_code} {r.text[:200]}")
        await asyncio.sleep(0.2)


async def do_generate(client, stats: Stats, h: History, restart: Restart) -> None:
    t0 = time.monotonic()
    r = await client.post("/generate", json=h.body())
    stats.answered += 1
    if r.status_code != 200:
        stats.note(f"generate_{r.status_code}", r.text)
        return
    stats.latencies.append((t0, time.monotonic() - t0))
    stats.note("generate_200")
    out = r.json()
    compare(stats, h, out["output_ids"], out["output_token_logprobs"], "generate", restart, t0)


async def do_stream(client, stats: Stats, h: History, restart: Restart, cut_after: int) -> None:
    """Stream ``h``; close the connection after ``cut_after`` tokens (0: read to the end)."""
    t0 = time.monotonic()
    tokens: list[int] = []
    lps: list[float] = []
    async with client.stream("POST", "/generate", json=h.body(stream=True)) as r:
        stats.answered += 1
        if r.status_code != 200:
            stats.note(f"stream_{r.status_code}", (await r.aread()).decode(errors="replace"))
            return
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                stats.note("stream_error_event", data)
                return
            tokens += ev["output_ids"]
            lps += ev["output_token_logprobs"]
            if cut_after and len(tokens) >= cut_after:
                break  # leaving the block closes the connection mid-stream
    if cut_after and not done:
        stats.note("stream_cut")
        compare(stats, h, tokens, lps, "stream_cut", restart, t0)
    elif done:
        stats.note("stream_200")
        how = "stream"
        if len(tokens) != h.max_new_tokens:
            stats.note("stream_short", f"{len(tokens)} of {h.max_new_tokens} tokens")
        compare(stats, h, tokens, lps, how, restart, t0)
    else:
        stats.note("stream_unterminated", f"{len(tokens)} tokens, no [DONE]")


async def do_bad(client, stats: Stats, cls: str, content: bytes) -> None:
    r = await client.post("/generate", content=content,
                          headers={"content-type": "application/json"})
    stats.answered += 1
    stats.note(cls if r.status_code == 400 else f"{cls.split('_')[0]}_{r.status_code}", r.text)


async def do_oversize(host: str, port: int, stats: Stats, timeout: float) -> None:
    """A body that declares more than the limit; only its first 64 KiB are sent (the server
    must answer from the header without reading the rest)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        head = (f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {BODY_LIMIT + 1}\r\n\r\n")
        writer.write(head.encode() + b" " * 65536)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        writer.close()
    if not line:
        raise httpx.RemoteProtocolError("connection closed without a response")
    stats.answered += 1
    status = int(line.split()[1])
    stats.note(f"oversize_{status}", line.decode(errors="replace").strip())


async def do_flush(client, stats: Stats) -> None:
    r = await client.post("/flush_cache")
    stats.answered += 1
    stats.note(f"flush_{r.status_code}", r.text)


async def client_loop(
    cid: int, url: str, pool: list[History], stats: Stats, restart: Restart, deadline: float,
    timeout: float, seed: int,
) -> None:
    rng = np.random.default_rng([seed, cid])
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout, connect=5.0),
                                 limits=limits) as client:
        for _ in range(1_000_000):  # bounded; the deadline ends it long before
            if time.monotonic() >= deadline:
                return
            x = rng.random()
            h = pool[int(rng.integers(len(pool)))]
            try:
                if x < 0.55:
                    await do_generate(client, stats, h, restart)
                    # An agent's next turns: the extensions of this history, in order.
                    while h.children and rng.random() < 0.5 and time.monotonic() < deadline:
                        h = pool[h.children[int(rng.integers(len(h.children)))]]
                        await do_generate(client, stats, h, restart)
                elif x < 0.70:
                    cut = int(rng.integers(1, h.max_new_tokens)) if rng.random() < 0.75 else 0
                    await do_stream(client, stats, h, restart, cut)
                elif x < 0.80:
                    await do_bad(client, stats, "invalid_400",
                                 json.dumps(invalid_body(rng, h)).encode())
                elif x < 0.90:
                    await do_bad(client, stats, "malformed_400",
                                 MALFORMED[int(rng.integers(len(MALFORMED)))])
                elif x < 0.95:
                    await do_oversize(host, int(port), stats, timeout)
                else:
                    await do_flush(client, stats)
            except (httpx.TransportError, OSError) as e:  # OSError: the raw socket's
                t = time.monotonic()
                if isinstance(e, httpx.TimeoutException | TimeoutError):
                    stats.note("timeout", repr(e))
                elif restart.in_window(t):
                    stats.note("restart_gap")
                    await asyncio.sleep(0.25)  # the server is down: retry shortly
                else:
                    stats.note("connection_error", repr(e))
                    await asyncio.sleep(0.25)


# --------------------------------------------------------------------------- server side


def server_rss(srv: LocalServer) -> float | None:
    """The server's VmRSS in MiB, to 0.1 (None once it is gone)."""
    rss = rss_mib(srv.proc.pid)
    return None if rss is None else round(rss, 1)


def cache_entries(folder: Path) -> set[str]:
    """Entry keys in JAX's persistent compile cache folder (file names minus '-cache')."""
    return {p.name.removesuffix("-cache") for p in folder.iterdir() if p.name.endswith("-cache")}


def cache_hits(stderr: list[str]) -> set[str]:
    return {m.group(1) for line in list(stderr) for m in [HIT.search(line)] if m}


async def crash_and_restart(
    server: dict[str, Any], args_list: list[str], port: str, at: float, restart: Restart,
    info: dict[str, Any], env: dict[str, str], cache_dir: Path,
) -> None:
    """SIGKILL the server at ``at`` and start it again with the same flags and port."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    old: LocalServer = server["srv"]
    info["rss_mib"]["first_before_kill"] = server_rss(old)
    before = cache_entries(cache_dir)
    restart.killed_at = time.monotonic()
    os.kill(old.proc.pid, signal.SIGKILL)
    await asyncio.to_thread(old.proc.wait, 30)
    t = time.monotonic()
    try:
        new = await asyncio.to_thread(LocalServer, [*args_list, "--port", port], 300.0, env)
    except RuntimeError as e:
        info["restart_error"] = str(e)
        restart.ready_at = time.monotonic()
        return
    restart.ready_at = time.monotonic()
    server["srv"] = new
    after = cache_entries(cache_dir)
    hits = cache_hits(new.stderr_lines)
    info.update(
        restart_ready_s=round(restart.ready_at - t, 2),
        restart_gap_s=round(restart.ready_at - restart.killed_at, 2),
        cache_entries_before_kill=len(before),
        cache_entries_lost=sorted(before - after),
        restart_cache_hits=len(hits),
        restart_hits_on_old_entries=len(hits & before),
    )
    info["_before_kill"] = before
    info["rss_mib"]["restart_ready"] = server_rss(new)


async def sample_rss(server: dict[str, Any], start: float, deadline: float,
                     out: list[tuple[float, int, float]]) -> None:
    """(seconds into the load, process number, VmRSS MiB) every 5 s: a steady climb late in
    a process's life is a leak, a rise that levels off is compile and allocator caches."""
    while time.monotonic() < deadline:
        srv: LocalServer = server["srv"]
        rss = server_rss(srv)
        if rss is not None and srv.proc.poll() is None:
            out.append((round(time.monotonic() - start, 1), int(srv is not server["first"]), rss))
        await asyncio.sleep(5.0)


def late_growth(series: list[tuple[float, int, float]], proc: int) -> float | None:
    """RSS growth of process ``proc`` over the second half of its samples."""
    xs = [r for _, p, r in series if p == proc]
    return round(xs[-1] - xs[len(xs) // 2], 1) if len(xs) >= 4 else None


async def soak(args: argparse.Namespace, cache_dir: Path) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    server_args = ["--model-path", "tiny", "--max-total-tokens", str(args.max_total_tokens),
                   "--page-size", str(args.page_size), "--compile-cache-dir", str(cache_dir)]
    # Debug logs of the compiler module only: they say which programs came from the cache.
    env = {"JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}
    # The machine may be shared: latencies mean little without the load it carried.
    info: dict[str, Any] = {"rss_mib": {}, "load_average_start": os.getloadavg()}
    t = time.monotonic()
    first = await asyncio.to_thread(LocalServer, server_args, 300.0, env)
    info["first_ready_s"] = round(time.monotonic() - t, 2)
    info["first_cache_hits"] = len(cache_hits(first.stderr_lines))
    info["rss_mib"]["first_ready"] = server_rss(first)
    server = {"srv": first, "first": first}
    url = first.url
    port = url.rsplit(":", 1)[1]
    try:
        pool: list[History] = []
        for _ in range(args.histories):
            pool.append(next_history(rng, pool))
            # The reference right away: a later extension may carry this answer as a segment.
            await reference_answers(url, pool[-1:], args.timeout)
        info["reference_s"] = round(time.monotonic() - t - info["first_ready_s"], 2)
        print(f"server ready in {info['first_ready_s']} s; {len(pool)} reference answers in "
              f"{info['reference_s']} s; load for {args.minutes} min with {args.clients} "
              f"clients", flush=True)

        stats, restart = Stats(), Restart()
        start = time.monotonic()
        deadline = start + 60.0 * args.minutes
        crash = asyncio.create_task(crash_and_restart(
            server, server_args, port, start + 30.0 * args.minutes, restart, info, env,
            cache_dir,
        ))
        series: list[tuple[float, int, float]] = []
        await asyncio.gather(
            sample_rss(server, start, deadline, series),
            *(client_loop(c, url, pool, stats, restart, deadline, args.timeout, args.seed)
              for c in range(args.clients)),
        )
        await crash
        load_s = time.monotonic() - start

        # End: wait until idle (cut streams' requests are aborted), flush, count pages.
        srv: LocalServer = server["srv"]
        leaked = None
        if srv.proc.poll() is None:
            end = time.monotonic() + 60
            while time.monotonic() < end and sum(
                metrics(url)[k] for k in ("akv_num_running_requests", "akv_num_waiting_requests")
            ):
                await asyncio.sleep(0.2)
            async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as client:
                await flush(client, 60.0)
            leaked = int(metrics(url)["akv_kv_pool_used_pages"])
            info["rss_mib"]["restart_end"] = server_rss(srv)
            # Programs from before the kill that the restarted server loaded, by the end.
            info["restart_hits_by_end"] = len(cache_hits(srv.stderr_lines) & info["_before_kill"])
    finally:
        server["srv"].stop()
        first.stop()

    unexpected = {k: v for k, v in stats.classes.items() if k not in EXPECTED | OK}
    restart_ok = (
        "restart_error" not in info and restart.ready_at is not None
        and not info["cache_entries_lost"] and info["restart_hits_on_old_entries"] > 0
        and stats.after_restart_checked > 0
    )
    rss = info["rss_mib"]
    first_run = [s for t, s in stats.latencies if not restart.after(t)]
    second_run = [s for t, s in stats.latencies if restart.after(t)]
    return {
        "settings": {**vars(args), "out": str(args.out) if args.out else None,
                     "server_args": server_args},
        "git": git_head(),
        "platform": platform.platform(),
        "load_average_start": info["load_average_start"],
        "load_s": round(load_s, 1),
        "requests_answered": stats.answered,
        "checked_answers": stats.classes["generate_200"] + stats.classes["stream_200"]
        + stats.classes["stream_cut"],
        "checked_after_restart": stats.after_restart_checked,
        "compared_tokens": stats.compared_tokens,
        "classes": dict(sorted(stats.classes.items())),
        "expected_errors": {k: v for k, v in sorted(stats.classes.items()) if k in EXPECTED},
        "unexpected_errors": dict(sorted(unexpected.items())),
        "examples": {k: v for k, v in stats.examples.items() if k not in OK},
        "mismatches": len(stats.mismatches),
        "mismatch_records": stats.mismatches,
        "latency_s": percentiles([s for _, s in stats.latencies]),
        # Apart: the first process compiles each new step shape as the load meets it, the
        # restarted one loads what took over 0.5 s to compile from the persistent cache.
        "latency_before_kill_s": percentiles(first_run),
        "latency_after_restart_s": percentiles(second_run),
        "leaked_pages": leaked,
        "restart": {k: v for k, v in info.items()
                    if k not in ("rss_mib", "load_average_start") and k[0] != "_"},
        "restart_ok": restart_ok,
        "rss_mib": rss,
        "rss_growth_mib": {
            "first_process": _diff(rss.get("first_before_kill"), rss.get("first_ready")),
            "restarted_process": _diff(rss.get("restart_end"), rss.get("restart_ready")),
            "end_vs_first_start": _diff(rss.get("restart_end"), rss.get("first_ready")),
            "first_process_late": late_growth(series, 0),
            "restarted_process_late": late_growth(series, 1),
        },
        "rss_series": series,
    }


def percentiles(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs if xs else [np.nan])
    return {"p50": round(float(np.percentile(a, 50)), 4),
            "p99": round(float(np.percentile(a, 99)), 4), "count": len(xs)}


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 1)


def report(res: dict[str, Any]) -> None:
    r = res["restart"]
    print(f"load phase {res['load_s']} s; requests answered {res['requests_answered']} "
          f"(answers checked against the references: {res['checked_answers']}, "
          f"{res['checked_after_restart']} after the restart, {res['compared_tokens']} tokens)")
    print("expected errors:   " + _fmt(res["expected_errors"]))
    print("unexpected errors: " + _fmt(res["unexpected_errors"]))
    for k, v in res["examples"].items():
        if k in res["unexpected_errors"] or k == "oversize_400":
            print(f"  e.g. {k}: {v[0] if v else ''}")
    print(f"mismatches: {res['mismatches']}")
    lat, a, b = res["latency_s"], res["latency_before_kill_s"], res["latency_after_restart_s"]
    print(f"latency of checked /generate requests: p50 {lat['p50']:.3f} s, p99 {lat['p99']:.3f} s"
          f" ({lat['count']} requests; before the kill p50 {a['p50']:.3f} p99 {a['p99']:.3f}, "
          f"after the restart p50 {b['p50']:.3f} p99 {b['p99']:.3f})")
    print(f"pages in use after the final flush: {res['leaked_pages']}")
    print(f"restart: first start {r.get('first_ready_s')} s ({r.get('first_cache_hits')} cache "
          f"hits), restart {r.get('restart_ready_s')} s, gap {r.get('restart_gap_s')} s, "
          f"{r.get('restart_hits_on_old_entries')} of {r.get('cache_entries_before_kill')} "
          f"cached programs loaded by ready, {r.get('restart_hits_by_end')} by the end, "
          f"{len(r.get('cache_entries_lost', []))} lost"
          + (f"; error: {r['restart_error']}" if "restart_error" in r else ""))
    rss, g = res["rss_mib"], res["rss_growth_mib"]
    print(f"server RSS (MiB): first process {rss.get('first_ready')} at ready -> "
          f"{rss.get('first_before_kill')} at the kill ({g['first_process']}); restarted "
          f"{rss.get('restart_ready')} -> {rss.get('restart_end')} at the end "
          f"({g['restarted_process']}); end vs first start {g['end_vs_first_start']}; "
          f"over the second half of each process's samples {g['first_process_late']} and "
          f"{g['restarted_process_late']}")


def _fmt(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="akv-soak-xla-") as cache_dir:
        res = asyncio.run(soak(args, Path(cache_dir)))
    res["wall_s"] = round(time.monotonic() - t, 1)
    out = args.out or Path(tempfile.mkstemp(prefix="soak-", suffix=".json")[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    records = res.pop("mismatch_records")
    if records:
        bad = out.with_name(out.stem + "-mismatches.json")
        bad.write_text(json.dumps(records, indent=1))
        res["mismatch_file"] = str(bad)
    out.write_text(json.dumps(res, indent=1))
    report(res)
    if records:
        print(f"mismatching requests saved to {res['mismatch_file']}")
    print(f"results: {out} (wall {res['wall_s']} s)")
    leaked = res["leaked_pages"]
    ok = (not res["mismatches"] and leaked == 0 and not res["unexpected_errors"]
          and res["restart_ok"] and res["checked_answers"] > 0)
    print(f"soak: {res['requests_answered']} requests, {res['mismatches']} mismatches, "
          f"{'?' if leaked is None else leaked} leaked pages, "
          f"restart {'ok' if res['restart_ok'] else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
