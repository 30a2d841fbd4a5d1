"""What the bench scripts share: provenance, timing, memory, test-support modules, and a
launcher for a server that is not akv_jax (akv_jax's own is
:class:`akv_jax.agent.launch.LocalServer`).

The scripts run as ``python bench/X.py`` from the repository root, so bench/ is on
``sys.path`` and ``from common import ...`` finds this file.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import math
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- provenance
def git_head() -> str:
    """HEAD of the checkout the numbers came from ("+dirty" when the tree has changes).

    Changes under bench/results/ do not count: a benchmark that rewrites its JSON after each
    repeat (bench/peers.py) would otherwise mark its own run dirty from the second repeat."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, text=True,
                                capture_output=True, check=True).stdout  # "XY path" lines
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    changed = [ln for ln in status.splitlines() if not ln[3:].startswith("bench/results/")]
    return head + ("+dirty" if changed else "")


# ---------------------------------------------------------------------------- timing
def median(xs: Sequence[float]) -> float:
    """The median, NaN for no values (a side that did not run)."""
    return statistics.median(xs) if xs else math.nan


def interleaved_medians(fns: Mapping[str, Callable[[], object]], repeats: int, *,
                        warm: bool = True) -> dict[str, float]:
    """Median seconds of each call, timed round-robin (one call of each per round) so the
    drifting speed of a shared host meets every contender alike. ``warm``: one untimed call
    of each first (it compiles). A call must wait for its own result (block_until_ready)."""
    if warm:
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def median_seconds(fn: Callable[[], object], repeats: int, *, warm: bool = True) -> float:
    """:func:`interleaved_medians` of one call."""
    return interleaved_medians({"fn": fn}, repeats, warm=warm)["fn"]


# ---------------------------------------------------------------------------- memory
def descendants(pid: int) -> list[int]:
    """The process ids of ``pid``'s children, their children, ... (from /proc, Linux)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def rss_mib(pid: int, *, children: bool = False) -> float | None:
    """Resident memory (VmRSS) of ``pid`` in MiB, with its descendants' when ``children``
    (vLLM runs its engine in a child process); None when nothing could be read."""
    total, found = 0, False
    for p in [pid, *(descendants(pid) if children else [])]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    found = True
    return total / 1024 if found else None


# ---------------------------------------------------------------------------- tests/
def tests_module(name: str) -> ModuleType:
    """The test-support module tests/NAME.py (pallas_cases, exactness), loaded from its file:
    putting tests/ on ``sys.path`` would let its module names shadow others'."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------- servers
def listening_ports(pid: int, host: str = "127.0.0.1") -> list[int]:
    """The TCP ports on which process ``pid`` (not its children) listens at IPv4 ``host`` or
    at every address (from /proc, Linux)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
    # /proc/net/tcp prints the address as one 32-bit number in the host's byte order.
    addresses = {f"{struct.unpack('=I', socket.inet_aton(a))[0]:08X}" for a in (host, "0.0.0.0")}
    ports = []
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
            cols = line.split()
            address, port = cols[1].split(":")
            if cols[3] == "0A" and cols[9] in inodes and address in addresses:  # 0A: LISTEN
                ports.append(int(port, 16))
    return ports


class ForeignServer:
    """A server that is not akv_jax (vLLM's), on ``host``, ready once ``GET /health`` answers 200.

    ``cmd`` asks for port 0: the server's own bind picks a free port, which is read back from
    the listening socket the process holds (:func:`listening_ports`), so no other process can
    take the port between choosing and binding it, and no other server can answer the health
    check. Output goes to ``log_path``; the server gets its own session, and :meth:`stop`
    signals the whole session (SIGINT, SIGKILL 30 s later): vLLM runs its engine in a child.
    """

    def __init__(self, name: str, cmd: Sequence[str], env: Mapping[str, str], log_path: Path,
                 ready_timeout: float, host: str = "127.0.0.1"):
        self.name, self.host, self.log_path = name, host, log_path
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(list(cmd), env=dict(env), stdout=self.log,
                                     stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                self.log.close()
                raise RuntimeError(f"{name} exited at start (see {log_path})")
            if time.perf_counter() - t0 > ready_timeout:
                self.stop()
                raise RuntimeError(f"{name} not ready in {ready_timeout:.0f} s ({log_path})")
            port = next((p for p in listening_ports(self.proc.pid, host) if self.healthy(p)),
                        None)
            if port is not None:
                break
            time.sleep(1)
        self.port = port
        self.startup_s = time.perf_counter() - t0

    def healthy(self, port: int) -> bool:
        """Whether ``GET /health`` on ``port`` answers 200."""
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection(self.host, port, timeout=5)
            try:
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            finally:
                conn.close()
        return False

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
