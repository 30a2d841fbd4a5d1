"""The bench scripts' side of a transformers + torch worker: a subprocess in a torch Python
(torch is not a project dependency), one JSON request line in, one JSON reply line out."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_TORCH_PYTHON = "/tmp/venvs/hf311/bin/python"


class TorchWorker:
    """``TorchWorker(python, "decode", threads)`` runs bench/torch_worker.py in that mode:
    ``info`` is the worker's ready line; ``call(**request)`` sends one request and returns its
    reply."""

    def __init__(self, python: str, mode: str, threads: int):
        self.proc = subprocess.Popen(
            [python, str(HERE / "torch_worker.py"), mode, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONSAFEPATH": "1"},  # bench/ off sys.path (torch_worker.py)
        )
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the transformers worker exited (is torch installed there?)")
        return json.loads(line)

    def call(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def start_workers(args: argparse.Namespace, mode: str) -> dict[int, TorchWorker]:
    """One ``mode`` worker per ``--torch-threads`` count, or none (with a note on stderr)
    when the model is not the default SmolLM2 or there is no torch Python."""
    if args.model != "default":
        print("transformers runs only on the default model: akv_jax side only", file=sys.stderr)
    elif args.torch_python and Path(args.torch_python).exists():
        return {n: TorchWorker(args.torch_python, mode, n) for n in args.torch_threads}
    else:
        print(f"no torch Python at {args.torch_python!r}: akv_jax side only", file=sys.stderr)
    return {}


def add_torch_args(ap: argparse.ArgumentParser) -> None:
    """The flags every torch comparison takes: which model, which torch Python, how many
    torch threads."""
    ap.add_argument("--model", default="default", help="default (SmolLM2-135M), tiny or a path")
    ap.add_argument("--torch-python", default=DEFAULT_TORCH_PYTHON)
    ap.add_argument(
        "--torch-threads",
        type=int,
        nargs="+",
        default=sorted({1, os.cpu_count() or 1}),
        help="torch thread counts to run; the ratio uses the fastest (default: 1 and all CPUs)",
    )
