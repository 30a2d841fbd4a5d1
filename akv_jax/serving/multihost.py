"""Multi-host serving on JAX's own distributed runtime.

Every process calls :func:`initialize` (``jax.distributed.initialize`` with the coordinator
address, process count and id); ``jax.devices()`` then lists the devices of all processes and
the engine's mesh spans them. JAX is multi-controller: every process must run the same jitted
steps in the same order. So process 0 runs the HTTP server and, once per engine-loop
iteration, broadcasts the commands it applied (new requests, aborts, cache flushes) and
whether it steps; the other processes run :func:`follower_loop`, which applies the same
commands to an identical engine and steps with it. The host-side planning is deterministic,
so every process builds the same batches; sampling seeds are fixed by process 0.

Faults. A request that fails in its own work (planning, sampling, ...) fails the same way
on every process, since the work is the same; the leader also replays each failure to the
followers (a ``fail`` command), so a fault that hit the leader alone, after the step's
forward, is dropped on the followers too. Before every forward all processes compare a
digest of what they are about to run (:func:`check_replicas`); any difference, a forward
that raised, or a peer that died or disconnected (a collective fails at once when a peer's
socket closes; the leader syncs at least once a second, even idle) raises
:class:`MultihostError` on the processes that see it: the leader fails every request and
exits with a one-line error, and a follower exits with one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from akv_jax.serving.types import describe_error

if TYPE_CHECKING:
    from akv_jax.serving.engine import Engine

STOP = "stop"

log = logging.getLogger("akv_jax.serving")


class MultihostError(RuntimeError):
    """The processes of a multi-host run can no longer run in lock step: a peer died or
    disconnected, or their engines diverged. Fatal; the message is one line."""


def is_peer_loss(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because a peer process went away (gloo and
    the distributed runtime word it so)."""
    text = str(e)
    return any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe",
                                   "heartbeat", "unhealthy", "UNAVAILABLE"))


def is_timeout(e: BaseException) -> bool:
    """Whether ``e`` is a collective that gave up waiting for its peers (gloo words it so,
    after ``--collective-timeout``)."""
    return "Timed out waiting" in str(e)


def peers() -> str:
    """The processes this one waits on in a collective, as its error messages name them:
    which collective notices a lost peer first is a race, so every collective on one
    process names them the same way."""
    if is_leader():
        return "the follower processes"
    if jax.process_count() == 2:
        return "the leader (process 0)"
    return "the other processes"


def peer_failure(e: BaseException, who: str | None = None) -> MultihostError:
    """The MultihostError for a collective that raised (``who``: the peers it waited on,
    by default :func:`peers`)."""
    who = who or peers()
    if is_timeout(e):
        return MultihostError(f"{who} did not join a collective within --collective-timeout: "
                              f"a process is stuck or out of step ({describe_error(e)})")
    if is_peer_loss(e):
        return MultihostError(f"lost {who}: a process died or disconnected ({describe_error(e)})")
    return MultihostError(f"a collective with {who} failed: {describe_error(e)}")


def initialize(coordinator: str, num_processes: int, process_id: int,
               collective_timeout_s: int = 600) -> None:
    """``jax.distributed.initialize``; on CPUs, gloo collectives that give up after
    ``collective_timeout_s`` (unless ``XLA_FLAGS`` sets it): a process that never reaches a
    collective (stuck, or out of step through a bug) then stops its peers with an error
    instead of leaving them waiting forever."""
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        # CPU devices of different processes talk through gloo collectives.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_cpu_collective_timeout_seconds" not in flags:
            # XLA reads its flags when the backend starts, which is after this.
            os.environ["XLA_FLAGS"] = (
                f"{flags} --xla_cpu_collective_timeout_seconds={collective_timeout_s}".strip())
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


def check_replicas(step: int, summary: bytes) -> None:
    """Raise MultihostError on every process unless all of them pass the same ``summary``
    (8 bytes, see :func:`digest`) for ``step`` (Engine.replica_check: what the step runs
    and the state it runs on). One small all-gather per step."""
    from jax.experimental import multihost_utils

    # int32 pieces: without jax_enable_x64 an int64 array would be cut to int32.
    mine = np.concatenate([[step % (1 << 31)], np.frombuffer(summary, np.int32)])
    mine = mine.astype(np.int32)
    try:
        every = np.asarray(multihost_utils.process_allgather(mine))
    except Exception as e:
        raise peer_failure(e) from e
    odd = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
    if odd:
        raise MultihostError(
            f"engines diverged at step {step}: processes {odd} differ from process 0 "
            "(a fault hit some processes and not others); stopping, restart the server"
        )


def digest(obj: Any) -> bytes:
    """A stable 8-byte hash of ``repr(obj)`` (Python's own hash() differs per process)."""
    return hashlib.blake2b(repr(obj).encode(), digest_size=8).digest()


def step_digest(engine: Engine, slices: list, decode_pass: list) -> bytes:
    """What ``engine``'s step runs (prefill ``slices``, the ``decode_pass``) and the state it
    runs on, hashed: the same on every process of a multi-host run unless their engines have
    diverged (:func:`check_replicas`)."""
    state = (
        [(r.rid, len(p.tokens), p.logits_row) for r, p in slices],
        [r.rid for r, _ in decode_pass],
        engine.cache.used_pages,
        [r.rid for r in engine.waiting],
        sorted(engine.running),
        sorted(engine.prefilling),
    )
    return digest(state)


def end_run_on_forward_error(e: Exception, what: str) -> None:
    """Across several processes a forward that raised (the ``what`` forward) ends the run:
    its collectives may have run on some processes and not on others, so no process can tell
    what the others' engines or KV hold any more. Raises there; returns in one process."""
    if jax.process_count() > 1:
        if is_peer_loss(e) or is_timeout(e):
            raise peer_failure(e) from e
        raise MultihostError(f"the {what} forward failed: {describe_error(e)}") from e


def apply_commands(engine: Engine, commands: list[tuple]) -> list[tuple[str, Any]]:
    """Apply replicated commands; returns (kind, result or exception) per command."""
    out = []
    for kind, payload in commands:
        try:
            if kind == "add":
                out.append((kind, engine.add_request(payload)))
            elif kind == "abort":
                out.append((kind, engine.abort(payload)))
            elif kind == "fail":  # a request the leader's engine failed
                out.append((kind, engine.fail(*payload)))
            elif kind == "method":
                name, args = payload
                out.append((kind, getattr(engine, name)(*args)))
            else:
                raise ValueError(f"unknown command {kind!r}")
        except Exception as e:  # the leader reports it to the client; followers move on
            out.append((kind, e))
    return out


def follower_loop(engine: Engine) -> None:
    """Mirror the leader's engine until it says stop (processes 1..N-1).

    Raises MultihostError (one line) when the leader is lost or this engine can no longer be
    kept identical to the leader's; the caller exits."""
    while True:
        try:
            msg = broadcast_object(None)
        except Exception as e:
            raise peer_failure(e) from e
        if msg == STOP:
            return
        commands, do_step = msg
        for (kind, payload), (_, res) in zip(commands, apply_commands(engine, commands),
                                             strict=True):
            if kind == "fail" and res is not None:
                log.warning("request %s failed on the leader (%s): dropped here too", *payload)
        if do_step:
            try:
                engine.step()  # per-request faults end those requests, as on the leader
            except MultihostError:
                raise
            except Exception as e:
                # The leader's step may have gone through: the engines may differ now.
                log.debug("follower step failed", exc_info=True)
                msg = f"engine step failed on this follower: {describe_error(e)}"
                raise MultihostError(msg) from e
