"""The bench scripts' side of a transformers + torch worker: a subprocess in a torch Python
(torch is not a project dependency), one JSON request line in, one JSON reply line out."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_TORCH_PYTHON = "/tmp/venvs/hf311/bin/python"


class TorchWorker:
    """``TorchWorker(python, "torch_decode_worker.py", threads)``: ``info`` is the worker's
    ready line; ``call(**request)`` sends one request and returns its reply."""

    def __init__(self, python: str, script: str, threads: int):
        self.proc = subprocess.Popen(
            [python, str(HERE / script), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
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
