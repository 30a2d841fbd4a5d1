"""Helpers for the server tests, which start servers with :class:`~akv_jax.agent.launch.LocalServer`
(``python -m akv_jax.serving.main`` on 127.0.0.1, ``--port 0``: no race for a free port).

Starting a server costs ~30 s on the CPU (model init + warm-up compile), so test modules
share one tiny-model server through :func:`shared_server`; it is stopped at interpreter exit.
"""

from __future__ import annotations

import atexit
import json
from collections.abc import Iterator, Sequence

import httpx

from akv_jax.agent.launch import LocalServer, metric_samples

# Tiny-model server settings shared by the tests (pool of 1024 pages of 16 tokens).
TINY_ARGS = ("--model-path", "tiny", "--max-total-tokens", "16384", "--page-size", "16")

# The tiny model of each agent-serving family, and the server the agents tests share for it
# (a small reasoning budget: a random model reasons until the budget closes the block).
AGENT_MODELS = ("tiny-gpt-oss", "tiny-gpt-oss-bpe", "tiny-qwen3-moe", "tiny-qwen3-moe-bpe",
                "tiny-minimax-m2")


def agent_server_args(model: str) -> tuple[str, ...]:
    return ("--model-path", model, "--max-total-tokens", "8192", "--page-size", "16",
            "--reasoning-budget", "6")


_shared: dict[tuple[str, ...], LocalServer] = {}


def shared_server(args: Sequence[str] = TINY_ARGS) -> LocalServer:
    """One server per argument list for the whole test session."""
    key = tuple(args)
    srv = _shared.get(key)
    if srv is None or srv.proc.poll() is not None:
        srv = LocalServer(args)
        _shared[key] = srv
    return srv


@atexit.register
def stop_shared() -> None:
    """Stop the shared servers. Also called at the end of a pytest session (conftest.py):
    a pytest-xdist worker may exit without running atexit handlers, which left them
    running after the suite."""
    for srv in _shared.values():
        srv.stop()
    _shared.clear()


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
    """The value of sample ``name`` in Prometheus text output (``name{k="v"}`` if labelled)."""
    return metric_samples(text)[name]


def scrape(client: httpx.Client) -> dict[str, float]:
    """Every sample of the server's ``/metrics`` (see :func:`metric_samples`)."""
    return metric_samples(client.get("/metrics").text)
