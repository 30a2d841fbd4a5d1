"""Where a benchmark's numbers came from: recorded in every results JSON."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
