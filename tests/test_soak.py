"""The CI-sized soak run (bench/soak.py --minutes 1): concurrent clients, cut streams, bad
bodies, flushes and a SIGKILL + restart of the server, every answer checked against the same
request answered alone. About 1.5 minutes of wall time on 2 CPU cores."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[1] / "bench" / "soak.py"
LAST_LINE = re.compile(
    r"soak: (\d+) requests, (\d+) mismatches, (\d+|\?) leaked pages, restart (ok|FAILED)"
)
# About 2,400 on 2 shared cores with 32 clients; far below means the load never ran.
MIN_REQUESTS = 500


def test_soak_one_minute(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--minutes", "1", "--clients", "32", "--histories", "24",
         "--out", str(tmp_path / "soak.json")],
        capture_output=True, text=True, timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    m = LAST_LINE.fullmatch(lines[-1])
    assert m, proc.stdout[-3000:] + proc.stderr[-3000:]
    requests, mismatches, leaked, restart = m.groups()
    report = proc.stdout[-3000:]
    assert mismatches == "0", report
    assert leaked == "0", report
    assert restart == "ok", report
    assert int(requests) >= MIN_REQUESTS, report
    assert proc.returncode == 0, report  # unexpected errors fail the run too
