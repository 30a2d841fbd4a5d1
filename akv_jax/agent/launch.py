"""Start a local ``akv_jax.serving.main`` subprocess for benchmarks (127.0.0.1 only).

The server picks a free port (``--port 0``) and prints ``akv_jax serving NAME on URL`` when it
accepts connections; :class:`LocalServer` waits for that line. The server keeps its compiled
step programs in its persistent compilation cache (``--compile-cache-dir``, default
``~/.cache/akv_jax/xla``), so repeated runs do not pay for XLA compiles again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

READY_PREFIX = "akv_jax serving "
COUNTERS = (
    "akv_cache_query_tokens_total",
    "akv_cache_hit_tokens_total",
    "akv_cache_evictions_total",
    "akv_cache_evicted_dead_pages_total",
    "akv_cache_restores_total",
    "akv_cache_restored_tokens_total",
    "akv_kv_pool_used_pages",
    "akv_kv_pool_total_pages",
)


class LocalServer:
    """``with LocalServer([...flags]) as srv: srv.url`` (stops with SIGINT on exit)."""

    def __init__(self, args: Sequence[str], timeout_s: float = 300.0, env: dict | None = None):
        cmd = [sys.executable, "-m", "akv_jax.serving.main", "--host", "127.0.0.1",
               "--port", "0", "--log-level", "warning", *args]
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )
        self.stderr: list[str] = []
        # Drain stderr so a chatty server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = self._wait_ready(timeout_s)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _wait_ready(self, timeout_s: float) -> str:
        found: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                if line.startswith(READY_PREFIX):
                    found.append(line.strip())
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout_s)
        if not found:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.stderr[-30:]))
        return found[0].rsplit(" ", 1)[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def counters(url: str) -> dict[str, float]:
    """The unlabelled counters of ``GET /metrics`` listed in :data:`COUNTERS`."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            out[name] = float(value)
    return out


def flush(url: str, timeout_s: float = 60.0) -> None:
    """Empty the server's prefix cache (retrying while requests still finish)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(url + "/flush_cache", timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            r.raise_for_status()
            return
        time.sleep(0.2)
