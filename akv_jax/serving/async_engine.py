"""The bridge between the asyncio server and the engine: :meth:`Engine.step` runs on one
background thread (the tree and pool are only ever touched there); requests stream
:class:`TokenEvent` s back to their event loops; in a multi-host run every command and step is
broadcast to the follower processes (see multihost.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import numpy as np

from akv_jax.serving.engine import Engine
from akv_jax.serving.multihost import (
    STOP,
    MultihostError,
    apply_commands,
    broadcast_object,
    peer_failure,
)
from akv_jax.serving.types import GenerateRequest, TokenEvent, describe_error

log = logging.getLogger("akv_jax.serving")


class AsyncEngine:
    """Runs :meth:`Engine.step` on one background thread; requests stream TokenEvents.

    Faults. A request that fails inside the engine ends its stream with a RuntimeError
    carrying a one-line message (the API answers 500, or ends an SSE stream with an error
    event); the others go on. A fault outside any one request's work fails every request
    and restarts from an empty cache. In a multi-host run that (or a lost follower, or
    engines found to differ) is fatal instead: the engine thread stops, every client waiting
    on it gets the error, :attr:`failure` holds it and ``on_fatal(message)`` is called
    (main.py shuts the server down with a one-line error)."""

    def __init__(
        self,
        engine: Engine,
        lockstep: bool = False,
        on_fatal: Callable[[str], None] | None = None,
    ):
        """``lockstep``: this is process 0 of a multi-host run (see multihost.py): every
        command and step is broadcast to the follower processes."""
        self.engine = engine
        self.lockstep = lockstep
        self.on_fatal = on_fatal
        self.failure: str | None = None  # why the engine stopped for good, once it has
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="akv-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def call(self, fn, *args, timeout: float = 120.0):
        """Run ``fn(engine, *args)`` on the engine thread and wait for its result.

        For inspection only: in a multi-host run it is not replicated to the followers
        (state changes go through :meth:`call_method`)."""
        return self._wait("call", (fn, args), timeout)

    def call_method(self, name: str, *args, timeout: float = 120.0):
        """Run ``engine.<name>(*args)`` on the engine thread (replicated across hosts)."""
        return self._wait("method", (name, args), timeout)

    def flush_cache(self) -> bool:
        return self.call_method("flush_cache")

    def _wait(self, kind: str, what: tuple, timeout: float):
        done = threading.Event()
        box: dict = {}
        self._check_running()
        self._inbox.put((kind, (*what, box, done)))
        self._wake.set()
        self._check_running()  # stopped meanwhile: _fatal may have drained the inbox already
        if not done.wait(timeout):
            raise TimeoutError(f"engine did not answer within {timeout} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _check_running(self) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the engine thread is not running")

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """The request's events. A request the engine failed raises RuntimeError (after any
        tokens it produced); closing the generator early aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[req.rid] = (loop, q)
        finished = False
        try:
            # Registered before this check, so a fatal stop either sees this stream (and
            # delivers its error) or happened before the check (which raises).
            self._check_running()
            # Validation errors (Engine.check, run again by add_request on the engine thread)
            # come back through the stream as exceptions.
            self._inbox.put(("add", req))
            self._wake.set()
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if item.error is not None:  # the engine failed it and released its pages
                    raise RuntimeError(item.error)
                yield item
        finally:
            with self._lock:
                self._streams.pop(req.rid, None)
            if not finished:  # the client went away: free the request's pages
                self._inbox.put(("abort", req.rid))
                self._wake.set()

    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # its event loop is closed: nobody is listening any more
                pass

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a lost multi-host peer, or a bug in the loop itself
            self._fatal(e)
            return
        if self.lockstep:
            try:
                broadcast_object(STOP)
            except Exception as e:
                log.warning("could not tell the followers to stop: %s", describe_error(e))

    def _serve(self) -> None:
        eng = self.engine
        last_sync = time.monotonic()
        # Multi-host: requests this process's engine failed, replayed on the followers with
        # the next broadcast, so that theirs drop them too (a no-op where they failed too).
        failed: list[tuple] = []
        while not self._stop.is_set():
            commands: list[tuple] = failed
            failed = []
            waiters: list[tuple[int, dict, threading.Event]] = []
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    if self.lockstep and payload.sampling.seed is None:
                        # Every process samples; they must draw the same numbers.
                        seed = int(np.random.default_rng().integers(2**31))
                        sampling = dataclasses.replace(payload.sampling, seed=seed)
                        payload = dataclasses.replace(payload, sampling=sampling)
                    commands.append(("add", payload))
                elif kind == "abort":
                    commands.append(("abort", payload))
                elif kind == "method":
                    name, args, box, done = payload
                    waiters.append((len(commands), box, done))
                    commands.append(("method", (name, args)))
                elif kind == "call":  # read-only inspection, never replicated
                    fn, args, box, done = payload
                    try:
                        box["value"] = fn(eng, *args)
                    except Exception as e:
                        box["error"] = e
                    done.set()
            results = apply_commands(eng, commands)
            for (kind, payload), (_, res) in zip(commands, results, strict=True):
                if kind == "add" and isinstance(res, BaseException):
                    self._deliver(payload.rid, res)
            for i, box, done in waiters:
                res = results[i][1]
                box["error" if isinstance(res, BaseException) else "value"] = res
                done.set()
            do_step = eng.has_work()
            if self.lockstep and (commands or do_step or time.monotonic() - last_sync > 1.0):
                # Also once a second when idle: a follower that died is noticed here.
                try:
                    broadcast_object((commands, do_step))
                except Exception as e:
                    raise peer_failure(e) from e
                last_sync = time.monotonic()
            if not do_step:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                events = eng.step()
            except MultihostError:
                raise
            except Exception as e:
                if self.lockstep:
                    # The followers' steps may have gone through: the engines may differ.
                    raise MultihostError(f"engine step failed: {describe_error(e)}") from e
                log.error("engine step failed: failing every request, emptying the cache",
                          exc_info=e)
                events = eng.reset(f"engine error: {describe_error(e)}")
            for ev in events:
                if ev.error is not None and self.lockstep:
                    failed.append(("fail", (ev.rid, ev.error)))
                self._deliver(ev.rid, ev)

    def _fatal(self, e: BaseException) -> None:
        """Stop for good: every waiting client gets the error, ``on_fatal`` is told."""
        msg = str(e) if isinstance(e, MultihostError) else f"engine stopped: {describe_error(e)}"
        log.error("%s", msg, exc_info=None if isinstance(e, MultihostError) else e)
        self.failure = msg  # first, so that new requests see it (see generate)
        err = RuntimeError(msg)
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._deliver(rid, err)
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind in ("method", "call"):
                box, done = payload[-2:]
                box["error"] = err
                done.set()
        if self.on_fatal is not None:
            self.on_fatal(msg)
