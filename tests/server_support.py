"""Helpers for the server tests: run ``python -m akv_jax.serving.main`` in a subprocess.

The server binds 127.0.0.1 with ``--port 0`` and prints its URL on its ready line, so there is
no race for a free port. Starting a server costs ~30 s on the CPU (model init + warm-up
compile), so test modules share one tiny-model server through :func:`shared_server`; it is
stopped at interpreter exit.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import httpx

READY_PREFIX = "akv_jax serving "
START_TIMEOUT_S = 300
# Tiny-model server settings shared by the tests (pool of 1024 pages of 16 tokens).
TINY_ARGS = ("--model-path", "tiny", "--max-total-tokens", "16384", "--page-size", "16")


class ServerProcess:
    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        launcher: Sequence[str] = ("-m", "akv_jax.serving.main"),
    ):
        """``launcher``: what follows the interpreter on the command line (e.g. ``-c`` and
        code that patches the engine before calling ``main``: fault injection)."""
        cmd = [sys.executable, *launcher, "--host", "127.0.0.1",
               "--port", "0", "--log-level", "warning", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )
        self.stderr_lines: list[str] = []
        # Drain stderr continuously so a chatty server never blocks on a full pipe.
        self._err_thread = threading.Thread(target=self._drain_stderr, daemon=True)
        self._err_thread.start()
        self.ready_line = self._wait_ready()
        self.url = self.ready_line.rsplit(" ", 1)[-1]

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        result: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                if line.startswith(READY_PREFIX):
                    result.append(line.strip())
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.monotonic()))
        if not result:
            self.stop()
            raise RuntimeError(
                f"server did not become ready (rc={self.proc.returncode}):\n"
                + "".join(self.stderr_lines[-40:])
            )
        return result[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._err_thread.join(timeout=5)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)


_shared: dict[tuple[str, ...], ServerProcess] = {}


def shared_server(args: Sequence[str] = TINY_ARGS) -> ServerProcess:
    """One server per argument list for the whole test session."""
    key = tuple(args)
    srv = _shared.get(key)
    if srv is None or srv.proc.poll() is not None:
        srv = ServerProcess(args)
        _shared[key] = srv
    return srv


@atexit.register
def _stop_shared() -> None:
    for srv in _shared.values():
        srv.stop()


def sse_events(lines: Iterator[str]) -> list[object]:
    """The ``data:`` payloads of a server-sent-event stream ('[DONE]' kept as a string)."""
    out: list[object] = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric_value(text: str, name: str) -> float:
    """The value of an unlabelled sample ``name`` in Prometheus text output."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
