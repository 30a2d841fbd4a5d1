"""One-shot chat from the command line: a greedy answer from a model.

    python -m akv_jax.chat "What is the capital of France?"
    python -m akv_jax.chat --model-path DIR --system "Be terse." --max-new-tokens 64 "Hi"

The prompt is tokenized as per-message segments (the unit of AKV cache operations) plus the
template's generation prompt, and decoded greedily until an end-of-turn token.
"""

from __future__ import annotations

import argparse
import sys

from akv_jax.model.causal import greedy_generate
from converters.loading import load_model


def answer(
    question: str,
    model_path: str | None = None,
    system: str | None = None,
    max_new_tokens: int = 128,
    dtype: str = "float32",
) -> str:
    model = load_model(model_path, dtype, progress=True)
    if model.tokenizer is None:
        raise ValueError(f"model {model.source} has no tokenizer")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    segments = model.tokenizer.encode_messages(messages, add_generation_prompt=True)
    prompt = [t for seg in segments for t in seg]
    _, ids = greedy_generate(
        model.params, model.cfg, prompt, max_new_tokens, stop_ids=model.stop_ids
    )
    if ids and ids[-1] in model.stop_ids:
        ids = ids[:-1]
    return model.tokenizer.decode(ids, skip_special_tokens=True).strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m akv_jax.chat", description=__doc__.split("\n")[0])
    ap.add_argument("question")
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--system", default=None, help="system message")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args(argv)
    try:
        text = answer(args.question, args.model_path, args.system, args.max_new_tokens, args.dtype)
    except (ValueError, OSError) as e:  # bad model path, tokenizer or template: one line
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
