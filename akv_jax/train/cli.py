"""``python -m akv_jax.train``: fine-tune a model through op histories.

    python -m akv_jax.train --model-path tiny --data train.jsonl --out runs/a \\
        --eval-data eval.jsonl --lora-rank 8 --steps 200 --batch 2 --lr 1e-3
    python -m akv_jax.train ... --out runs/a --resume      # continue a stopped run
    python -m akv_jax.train ... --batch 4 --dp 2 --tp 2    # data + tensor parallel, 4 devices

Every token is predicted under the view it had (its trajectory's ops, one forward pass per
packed example). The run writes into ``--out``:

* ``log.jsonl``: one line per step (``step``, ``loss``, ``tokens``, ``tokens_per_s``) and per
  evaluation (``eval_loss_ops``: the held-out trajectories under their ops;
  ``eval_loss_full``: the same trajectories with the ops removed, i.e. in full context);
* ``checkpoints/``: orbax checkpoints (params or LoRA weights, optimiser state, step and the
  data iterator's state), every ``--save-every`` steps and at the end; ``--resume`` restores
  the latest and continues with exactly the losses an uninterrupted run logs;
* ``model/``: at the end, the trained model for serving (LoRA merged):
  ``python -m akv_jax.serving.main --model-path OUT/model``.

A bad flag, data file or model is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

PROG = "python -m akv_jax.train"
EXIT_USAGE = 2
LOG_NAME, CKPT_DIR, MODEL_DIR = "log.jsonl", "checkpoints", "model"


class UsageError(Exception):
    """Bad input: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # one line, as the server's command line reports it
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _number(kind: type, name: str, lo: float, strict: bool = False):
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(v) or v < lo or (strict and v == lo):
            bound = f"above {lo}" if strict else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {text}")
        return v

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Fine-tune a model under cache engineering.")
    a = p.add_argument
    a("--model-path", default=None, help="as the server's --model-path (default: SmolLM2)")
    a("--data", required=True, help="training trajectories (JSONL, akv_jax.train.sources)")
    a("--out", required=True, help="run folder: log, checkpoints, exported model")
    a("--eval-data", default=None, help="held-out trajectories, evaluated under both views")
    a(
        "--lora-rank",
        type=_number(int, "--lora-rank", 0),
        default=0,
        help="LoRA on the attention and MLP projections (0: full fine-tuning)",
    )
    a(
        "--lora-alpha",
        type=_number(float, "--lora-alpha", 0, strict=True),
        default=None,
        help="LoRA scale numerator (default: the rank)",
    )
    a("--steps", type=_number(int, "--steps", 1), default=100)
    a("--batch", type=_number(int, "--batch", 1), default=1, help="packed examples per step")
    a("--accum", type=_number(int, "--accum", 1), default=1, help="gradient accumulation")
    a("--lr", type=_number(float, "--lr", 0, strict=True), default=1e-4)
    a(
        "--warmup",
        type=_number(int, "--warmup", 0),
        default=None,
        help="warmup steps (default: 10%% of --steps)",
    )
    a("--weight-decay", type=_number(float, "--weight-decay", 0), default=0.0)
    a(
        "--clip",
        type=_number(float, "--clip", 0, strict=True),
        default=1.0,
        help="gradient clipping (global norm)",
    )
    a(
        "--max-tokens",
        type=_number(int, "--max-tokens", 16),
        default=1024,
        help="tokens per packed example (a multiple of 16)",
    )
    a("--max-segments", type=_number(int, "--max-segments", 1), default=64)
    a("--max-trajectories", type=_number(int, "--max-trajectories", 1), default=8)
    a(
        "--max-versions",
        type=_number(int, "--max-versions", 1),
        default=8,
        help="repositions + 1 per trajectory",
    )
    a("--loss-roles", default="assistant", help="comma-separated roles whose tokens are targets")
    a("--seed", type=int, default=0)
    a(
        "--eval-every",
        type=_number(int, "--eval-every", 1),
        default=None,
        help="steps between evaluations (default: at the start and the end only)",
    )
    a(
        "--save-every",
        type=_number(int, "--save-every", 1),
        default=None,
        help="steps between checkpoints (default: at the end only)",
    )
    a(
        "--stop-after",
        type=_number(int, "--stop-after", 1),
        default=None,
        help="leave after this many steps of this invocation, as if killed (for tests)",
    )
    a("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    a("--dtype", choices=("float32", "bfloat16"), default="float32")
    a(
        "--dp",
        type=_number(int, "--dp", 1),
        default=1,
        help="data-parallel degree: each step's --batch packs split over this many devices",
    )
    a(
        "--tp",
        type=_number(int, "--tp", 1),
        default=1,
        help="tensor-parallel degree (heads and FFN width, the server's sharding rules)",
    )
    a(
        "--compile-cache-dir",
        default=None,
        help="persistent XLA compilation cache, as the server's (default: $AKV_JAX_CACHE/xla; "
        "'none' turns it off)",
    )
    a("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


@dataclasses.dataclass
class Log:
    """``log.jsonl``: appended line by line; on resume, cut back to the restored step."""

    path: Path

    def restart(self, step: int) -> None:
        """Keep the entries up to ``step`` (a killed run may have left a torn last line)."""
        if not self.path.exists():
            return
        keep = []
        for ln in self.path.read_text().splitlines():
            try:
                entry = json.loads(ln)
            except json.JSONDecodeError:
                continue
            if entry["step"] <= step:
                keep.append(ln)
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, **entry: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def read_log(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # imported after parsing, so --help and flag errors are instant
    from akv_jax.errors import InvalidField
    from akv_jax.model.tokenizer import TokenizerError
    from akv_jax.serving.main import StartupError
    from akv_jax.train.sources import DataError
    from converters.loading import ModelLoadError

    try:
        return run(args)
    except (UsageError, DataError, InvalidField, ModelLoadError, TokenizerError, StartupError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def check_args(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if args.max_tokens % 16:
        raise UsageError(f"--max-tokens must be a multiple of 16, got {args.max_tokens}")
    if args.batch % args.dp:
        raise UsageError(f"--batch {args.batch} does not split over --dp {args.dp}")
    for name in ("data", "eval_data"):
        path = getattr(args, name)
        if path is not None and not Path(path).is_file():
            raise UsageError(f"--{name.replace('_', '-')}: no such file: {path}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {out} is not a folder")
    has_ckpt = (out / CKPT_DIR).is_dir() and any((out / CKPT_DIR).iterdir())
    if args.resume and not has_ckpt:
        raise UsageError(f"--resume: no checkpoint in {out / CKPT_DIR}")
    if not args.resume and (has_ckpt or (out / LOG_NAME).exists()):
        raise UsageError(f"--out: {out} already holds a run; pass --resume or a new folder")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    import jax
    from tqdm import tqdm

    from akv_jax.serving.main import enable_compile_cache
    from akv_jax.train import data as pipeline
    from akv_jax.train.sources import Tokenise, without_ops
    from akv_jax.train.trainer import Trainer
    from converters.loading import load_model

    enable_compile_cache(args.compile_cache_dir)
    mesh = None
    if args.dp * args.tp > 1:
        from akv_jax.model.params import make_mesh

        devices = jax.local_devices()
        if args.dp * args.tp > len(devices):
            raise UsageError(
                f"--dp {args.dp} x --tp {args.tp} needs {args.dp * args.tp} devices; this "
                f"process has {len(devices)}"
            )
        mesh = make_mesh(args.tp, devices[: args.dp * args.tp])
    out = Path(args.out)
    roles = tuple(r.strip() for r in args.loss_roles.split(",") if r.strip())
    model = load_model(args.model_path, args.dtype)
    try:
        tokenise = Tokenise(model.tokenizer, model.cfg.vocab_size, model.stop_ids, roles)
    except ValueError as e:
        raise UsageError(f"--loss-roles: {e}") from None
    trainer = Trainer(model, args, mesh)
    # Validate every record before the first step: a bad line fails now, not hours in.
    pipeline.read_all(args.data, tokenise, trainer.packer)
    evals = pipeline.read_all(args.eval_data, tokenise, trainer.packer) if args.eval_data else []
    eval_views = {"ops": evals, "full": [without_ops(t) for t in evals]}

    batches = pipeline.train_batches(
        args.data,
        tokenise,
        trainer.packer,
        batch_size=args.batch,
        seed=args.seed,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
    )
    it = iter(batches)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / LOG_NAME)
    step = 0
    if args.resume:
        step = trainer.restore(out / CKPT_DIR, it)
        log.restart(step)
    elif evals:
        log.write(step=0, **trainer.evaluate(eval_views))

    bar = tqdm(
        total=args.steps,
        initial=step,
        disable=args.no_progress,
        desc="train",
        unit="step",
        dynamic_ncols=True,
    )
    stop = args.steps if args.stop_after is None else min(args.steps, step + args.stop_after)
    while step < stop:
        batch = next(it)
        t0 = time.perf_counter()
        loss, tokens = trainer.step(batch)
        dt = time.perf_counter() - t0
        step += 1
        log.write(step=step, loss=loss, tokens=tokens, tokens_per_s=tokens / dt)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens / dt:.0f}")
        last = step == args.steps
        if evals and (last or (args.eval_every and step % args.eval_every == 0)):
            ev = trainer.evaluate(eval_views)
            log.write(step=step, **ev)
            bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))
        if last or (args.save_every and step % args.save_every == 0):
            trainer.save(out / CKPT_DIR, step, it)
    bar.close()
    if step < args.steps:  # --stop-after: leave as a killed run would, without exporting
        return 0
    trainer.export(out / MODEL_DIR)
    print(
        f"exported {out / MODEL_DIR} (python -m akv_jax.serving.main --model-path "
        f"{out / MODEL_DIR})"
    )
    return 0
