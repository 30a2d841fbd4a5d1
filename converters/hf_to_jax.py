"""Convert a Hugging Face safetensors checkpoint or a GGUF file into an akv_jax checkpoint.

    python -m converters.hf_to_jax --hf-dir IN --out OUT [--dtype float32|bfloat16]
                                   [--moe-weight-format dense|mxfp4]
    python -m converters.hf_to_jax --gguf FILE --out OUT [--dtype float32|bfloat16]

OUT receives config.json, an orbax checkpoint of the params (``params/``) and the tokenizer
files (copied from IN, or rebuilt from the GGUF metadata). GPT-OSS folders as released (MXFP4
expert ``*_blocks`` / ``*_scales``, ``quantization_config.quant_method == "mxfp4"``) are
dequantised and stored dense in ``--dtype``; with ``--moe-weight-format mxfp4`` their expert
weights are stored packed as released (uint8 ``<param>.blocks`` / ``<param>.scales``, gate_up
de-interleaved; ~4.25 bits a weight, and never dense on the host), which the server loads
packed with ``--moe-weight-format mxfp4`` or dequantises otherwise. Block-scaled FP8 releases
(MiniMax-M2, Qwen3 FP8: float8_e4m3fn ``weight`` + float32 ``weight_scale_inv``,
``quantization_config.quant_method == "fp8"``) are dequantised tensor by tensor and stored
dense in ``--dtype``. A source with dense
experts is refused with that flag: conversion never changes a value. Every tensor name and
shape is checked against the config before any weight is read. Any failure prints one
``error: ...`` line on stderr and exits with status 1.
"""

from __future__ import annotations

import argparse
import sys

from converters.convert import NP_DTYPES, convert_to_checkpoint
from converters.sources import open_source


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m converters.hf_to_jax", description=__doc__.split("\n")[0]
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="HF checkpoint folder (config.json + *.safetensors)")
    src.add_argument("--gguf", help="GGUF file (llama or qwen3 architecture)")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--dtype", choices=sorted(NP_DTYPES), default="float32")
    ap.add_argument("--moe-weight-format", choices=("dense", "mxfp4"), default="dense",
                    help="mxfp4: keep a released checkpoint's MXFP4 expert weights packed")
    ap.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        source = open_source(hf_dir=args.hf_dir, gguf=args.gguf)
        out = convert_to_checkpoint(
            source, args.out, args.dtype, overwrite=args.force, progress=not args.quiet,
            keep_packed=args.moe_weight_format == "mxfp4",
        )
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1
    except Exception as e:  # one line, never a traceback: this is a user-facing tool
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        kind = "" if isinstance(e, ValueError | OSError) else f"{type(e).__name__}: "
        print(f"error: {kind}{msg}", file=sys.stderr)
        return 1
    experts = ", MXFP4 experts" if args.moe_weight_format == "mxfp4" else ""
    print(f"wrote {out} ({source.config.arch}, {args.dtype}{experts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
