"""Multi-host serving on JAX's own distributed runtime.

Every process calls :func:`initialize` (``jax.distributed.initialize`` with the coordinator
address, process count and id); ``jax.devices()`` then lists the devices of all processes and
the engine's mesh spans them. JAX is multi-controller: every process must run the same jitted
steps in the same order. So process 0 runs the HTTP server and, once per engine-loop
iteration, broadcasts the commands it applied (new requests, aborts, cache flushes) and
whether it steps; the other processes run :func:`follower_loop`, which applies the same
commands to an identical engine and steps with it. The host-side planning is deterministic,
so every process builds the same batches; sampling seeds are fixed by process 0.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np

STOP = "stop"


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        # CPU devices of different processes talk through gloo collectives.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )


def is_leader() -> bool:
    return jax.process_index() == 0


def broadcast_object(obj: Any = None) -> Any:
    """Process 0's ``obj``, on every process (the others pass None)."""
    from jax.experimental import multihost_utils

    data = pickle.dumps(obj) if is_leader() else b""
    n = int(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64))[0])
    buf = np.zeros(n, np.uint8)
    if is_leader():
        buf[:] = np.frombuffer(data, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return pickle.loads(buf.tobytes())


def apply_commands(engine, commands: list[tuple]) -> list[tuple[str, Any]]:
    """Apply replicated commands; returns (kind, result or exception) per command."""
    out = []
    for kind, payload in commands:
        try:
            if kind == "add":
                out.append((kind, engine.add_request(payload)))
            elif kind == "abort":
                out.append((kind, engine.abort(payload)))
            elif kind == "method":
                name, args = payload
                out.append((kind, getattr(engine, name)(*args)))
            else:
                raise ValueError(f"unknown command {kind!r}")
        except Exception as e:  # the leader reports it to the client; followers move on
            out.append((kind, e))
    return out


def follower_loop(engine) -> None:
    """Mirror the leader's engine until it says stop (processes 1..N-1)."""
    while True:
        msg = broadcast_object(None)
        if msg == STOP:
            return
        commands, do_step = msg
        apply_commands(engine, commands)
        if do_step:
            engine.step()
