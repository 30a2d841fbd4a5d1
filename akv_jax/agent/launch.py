"""Start a local ``python -m akv_jax.serving.main`` subprocess (127.0.0.1 only).

The one way this project starts a server from Python: benchmarks, the test suite and notebook
users all use :class:`LocalServer`. The server binds a free port (``--port 0``) and prints
``akv_jax serving NAME on URL`` once it accepts connections; :class:`LocalServer` waits for
that line, so there is no race for a port. The server keeps its compiled step programs in its
persistent compilation cache (``--compile-cache-dir``, default ``~/.cache/akv_jax/xla``), so
repeated runs do not pay for XLA compiles again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

READY_PREFIX = "akv_jax serving "
MODULE = ("-m", "akv_jax.serving.main")
COUNTERS = (
    "akv_cache_query_tokens_total",
    "akv_cache_hit_tokens_total",
    "akv_cache_evictions_total",
    "akv_cache_evicted_dead_pages_total",
    "akv_cache_restores_total",
    "akv_cache_restored_tokens_total",
    "akv_kv_pool_used_pages",
    "akv_kv_pool_total_pages",
    "akv_kv_host_used_pages",
    "akv_kv_offloaded_pages_total",
    "akv_kv_reloaded_pages_total",
    "akv_kv_host_evicted_pages_total",
    "akv_engine_preemptions_total",
    "akv_engine_admission_waits_total",
)


class LocalServer:
    """``with LocalServer(["--model-path", "tiny"]) as srv: httpx.get(srv.url + "/health")``.

    Runs ``python -m akv_jax.serving.main --host 127.0.0.1 --port 0 --log-level warning
    *args`` (a flag given again in ``args`` wins: ``["--port", "8000"]`` picks the port,
    ``["--log-level", "info"]`` a louder log) with ``env`` added to this process's
    environment, and returns once the server is ready (``url``, ``ready_line``). Its stderr
    is collected line by line in ``stderr_lines`` (and any other stdout in ``stdout_lines``)
    while it runs, so a chatty server never blocks on a full pipe; ``proc`` is the
    :class:`subprocess.Popen`. :meth:`stop` (also on leaving the ``with`` block) sends SIGINT,
    a clean shutdown, and kills the process only if it has not exited 30 s later.

    ``launcher`` is what follows the interpreter on the command line: ``("-c", code)`` runs
    ``code`` instead of the module (say, to patch the engine and then call
    ``akv_jax.serving.main.main(sys.argv[1:])``); ``python`` is the interpreter (this one by
    default). Raises :class:`RuntimeError`, with the end of the server's stderr, if it is not
    ready within ``timeout_s`` or exits first.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        timeout_s: float = 300.0,
        env: Mapping[str, str] | None = None,
        *,
        launcher: Sequence[str] = MODULE,
        python: str = sys.executable,
    ):
        self.cmd = [python, *launcher, "--host", "127.0.0.1", "--port", "0",
                    "--log-level", "warning", *args]
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self.ready_line: str | None = None
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for t in self._readers:
            t.start()
        self._ready.wait(timeout_s)
        if self.ready_line is None:
            exited = self.proc.poll() is not None
            rc = self.stop()
            why = f"exited (rc={rc})" if exited else f"was not ready within {timeout_s:g} s"
            raise RuntimeError(
                f"server {why}: {' '.join(self.cmd)}\n" + "".join(self.stderr_lines[-40:])
            )
        self.url = self.ready_line.rsplit(" ", 1)[-1]

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            if self.ready_line is None and line.startswith(READY_PREFIX):
                self.ready_line = line.strip()
                self._ready.set()
            else:
                self.stdout_lines.append(line)
        self._ready.set()  # end of output: the process is gone, ready or not

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def client(self, timeout: float = 120.0, **kw) -> httpx.Client:
        """An :class:`httpx.Client` for this server (``base_url`` set)."""
        return httpx.Client(base_url=self.url, timeout=timeout, **kw)

    def stop(self) -> int:
        """Stop the server (SIGINT, then SIGKILL after 30 s) and return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for t in self._readers:  # the pipes close with the process: its last lines are in
            t.join(timeout=5)
        return self.proc.returncode

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def metric_samples(text: str) -> dict[str, float]:
    """Every sample of Prometheus text output (``GET /metrics``), keyed by its name, with its
    labels in the printed order: ``akv_kv_pool_used_pages``, ``name{method="POST",...}``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items())
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metrics(url: str) -> dict[str, float]:
    """:func:`metric_samples` of the server at ``url``."""
    return metric_samples(httpx.get(url + "/metrics", timeout=30).text)


def counters(url: str) -> dict[str, float]:
    """The unlabelled counters of ``GET /metrics`` listed in :data:`COUNTERS`."""
    return {k: v for k, v in metrics(url).items() if k in COUNTERS}


def flush(url: str, timeout_s: float = 60.0) -> None:
    """Empty the server's prefix cache (retrying while requests still finish)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(url + "/flush_cache", timeout=30)
        if r.status_code == 200 or time.monotonic() > deadline:
            r.raise_for_status()
            return
        time.sleep(0.2)
