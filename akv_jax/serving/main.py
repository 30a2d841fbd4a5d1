"""``python -m akv_jax.serving.main``: serve a model over HTTP (see "Serving" in README.md).

With no flags it serves the embedded default model on 127.0.0.1:30000. Every startup problem
(bad flag, unloadable model, port in use) is one line on stderr and a non-zero exit, never a
traceback; ``--log-level debug`` logs the traceback as well.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import uvicorn

if TYPE_CHECKING:
    from akv_jax.serving.engine import Engine

log = logging.getLogger("akv_jax.serving")

PROG = "python -m akv_jax.serving.main"
EXIT_USAGE, EXIT_FAILURE = 2, 1


class StartupError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILURE):
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; one line is easier to read in a log.
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _at_least(name: str, low: int, kind=int):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {text!r}") from None
        if not v >= low:
            raise argparse.ArgumentTypeError(f"{name} must be at least {low}, got {text}")
        return v

    return parse


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from akv_jax.formats.reply import FAMILIES

    p = _Parser(prog=PROG, description="Serve a model with AKV cache operations over HTTP.")
    p.add_argument("--model-path", default=None,
                   help="Hugging Face folder, .gguf file, converted checkpoint, or a small "
                        "random model: 'tiny', 'tiny-gpt-oss', 'tiny-gpt-oss-bpe', "
                        "'tiny-minimax-m2', 'tiny-qwen3-moe', 'tiny-qwen3-moe-bpe' "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="model name reported by /v1/models (default: from --model-path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=30000, help="0 picks a free port")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--moe-weight-format", choices=("dense", "mxfp4"), default="dense",
                   help="mxfp4: keep MoE expert weights packed on the device (GPT-OSS's "
                   "released layout), dequantised per tile inside the grouped matmul")
    p.add_argument("--attention-backend", choices=("auto", "reference", "pallas"), default="auto")
    p.add_argument("--max-total-tokens", type=_at_least("--max-total-tokens", 1), default=16384,
                   help="KV pool size in tokens")
    p.add_argument("--host-kv-tokens", type=_at_least("--host-kv-tokens", 0), default=None,
                   help="host-memory KV tier in tokens: evicted live KV is copied there and "
                        "reloaded instead of recomputed (default: 4x --max-total-tokens; 0: "
                        "none; single-process only)")
    p.add_argument("--admission-window-s", type=_at_least("--admission-window-s", 0, float),
                   default=10.0,
                   help="while others run, a prefill waits rather than evict live KV used in "
                        "the last this many seconds that would be lost (not spilled)")
    p.add_argument("--admission-max-wait-s",
                   type=_at_least("--admission-max-wait-s", 0, float), default=2.0,
                   help="longest such a wait; then it evicts by least recent use")
    p.add_argument("--page-size", type=_at_least("--page-size", 1), default=16)
    p.add_argument("--context-length", type=_at_least("--context-length", 1), default=None,
                   help="position limit of a request (default: the model's "
                        "max_position_embeddings); above it only for the random 'tiny' model")
    p.add_argument("--tp", type=_at_least("--tp", 1), default=1, help="tensor-parallel degree")
    p.add_argument("--dist-coordinator", default=None, metavar="HOST:PORT",
                   help="multi-host: jax.distributed coordinator address (process 0's)")
    p.add_argument("--num-processes", type=_at_least("--num-processes", 1), default=1,
                   help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, default=0,
                   help="multi-host: this process's id (0 serves HTTP, the others follow)")
    p.add_argument("--collective-timeout", type=_at_least("--collective-timeout", 1), default=600,
                   help="multi-host on CPUs: seconds a collective waits for its peers before "
                        "it fails with an error (a stuck or out-of-step process)")
    p.add_argument("--disaggregate", type=_pair, default=None, metavar="P,D",
                   help="prefill on the first P devices, decode on the next D")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--max-running-requests", type=_at_least("--max-running-requests", 1),
                   default=16)
    p.add_argument("--prefill-chunk", type=_at_least("--prefill-chunk", 1), default=4096,
                   help="most prompt tokens computed in one scheduler step; a longer prefill "
                        "runs in slices over several steps while running requests decode")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read every step's greedy tokens before planning the next (by default "
                        "they are read a step late, the next step planned while the device "
                        "runs: docs/serving.md)")
    p.add_argument("--deterministic", action="store_true",
                   help="a request's bits independent of the batch on GPU and TPU too: "
                        "fixed-tile products, attention without split-K (on the CPU every "
                        "mode is; docs/design.md)")
    p.add_argument("--max-new-tokens-limit", type=_at_least("--max-new-tokens-limit", 1),
                   default=32768, help="largest max_new_tokens / max_tokens a request may ask")
    p.add_argument("--reply-format", choices=FAMILIES, default=None,
                   help="how chat replies are parsed into content, reasoning and tool calls "
                        "(default: from the model's architecture; docs/agents.md)")
    p.add_argument("--reasoning-budget", type=_at_least("--reasoning-budget", 0),
                   default=256,
                   help="tokens a reply held to a tool call or JSON schema may reason first")
    p.add_argument("--compile-cache-dir", default=None,
                   help="persistent XLA compilation cache, so restarts skip compiles "
                        "(default: $AKV_JAX_CACHE/xla, i.e. ~/.cache/akv_jax/xla; 'none' "
                        "turns it off)")
    p.add_argument("--skip-warmup", action="store_true",
                   help="do not compile the forward pass with a dummy request before serving")
    p.add_argument("--warmup-shapes", action="store_true",
                   help="before serving, run every prefill and decode step shape up to "
                        "--prefill-chunk tokens, --max-running-requests rows and the position "
                        "limit, so that no request waits for a compile (or, with a warm "
                        "compile cache, for a load) of its step shape")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


def _pair(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P,D (two integers), got {text!r}") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"P and D must be at least 1, got {text!r}")
    return a, b


def served_name(model_path: str | None) -> str:
    if model_path in (None, "", "default"):
        from converters.loading import DEFAULT_MODEL

        return DEFAULT_MODEL
    path = Path(model_path)
    return path.stem if path.suffix == ".gguf" else (path.resolve().name or str(model_path))


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before the (slow) model load, so a taken port fails at once."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _url(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def warmup(engine, all_shapes: bool = False) -> None:
    """Compile the prefill and decode shapes a short request uses, then forget it; with
    ``all_shapes``, every step shape of the common path too (Engine.warm_up_shapes)."""
    from akv_jax.cache.ops import OpHistory
    from akv_jax.serving.types import GenerateRequest, SamplingParams

    req = GenerateRequest("warmup", [[0, 1, 2, 3]], OpHistory.empty(1),
                          SamplingParams(max_new_tokens=2, ignore_eos=True), return_logprob=True)
    engine.add_request(req)
    while engine.has_work():
        engine.step()
    engine.flush_cache()
    if all_shapes:
        t = time.perf_counter()
        n = engine.warm_up_shapes()
        log.info("ran %d step shapes in %.0f s (--warmup-shapes)", n, time.perf_counter() - t)


def init_distributed(args: argparse.Namespace) -> None:
    """jax.distributed.initialize, before anything touches a device."""
    if not args.dist_coordinator:
        raise StartupError("--num-processes > 1 needs --dist-coordinator HOST:PORT", EXIT_USAGE)
    if not 0 <= args.process_id < args.num_processes:
        raise StartupError(
            f"--process-id {args.process_id} not in [0, {args.num_processes})", EXIT_USAGE
        )
    from akv_jax.serving.multihost import initialize

    try:
        initialize(args.dist_coordinator, args.num_processes, args.process_id,
                   args.collective_timeout)
    except Exception as e:
        raise StartupError(f"cannot join {args.dist_coordinator}: {e}") from None


def check_args(args: argparse.Namespace) -> None:
    """Flag combinations argparse cannot check on its own."""
    if args.tp > 1 or args.disaggregate is not None:
        import jax

        from akv_jax.serving.executor import check_devices

        try:
            check_devices(args.tp, args.disaggregate, jax.device_count(), args.deterministic)
        except ValueError as e:
            raise StartupError(str(e), EXIT_USAGE) from None
    if args.max_total_tokens < args.page_size:
        raise StartupError(
            f"--max-total-tokens {args.max_total_tokens} is smaller than one page "
            f"(--page-size {args.page_size})", EXIT_USAGE,
        )


def enable_compile_cache(where: str | None) -> None:
    """Point JAX's persistent compilation cache at ``where`` (see --compile-cache-dir)."""
    if where == "none":
        return
    import jax

    from converters.loading import cache_root

    path = Path(where) if where else cache_root() / "xla"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StartupError(f"--compile-cache-dir {path}: {e.strerror}", EXIT_USAGE) from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def build_engine(args: argparse.Namespace):
    """Load the model and start the engine (StartupError on any failure)."""
    from akv_jax.serving.engine import Engine
    from converters.loading import TINY_MODELS, load_model

    what = args.model_path or "the default model"
    enable_compile_cache(args.compile_cache_dir)
    placement = None
    if args.tp > 1 or args.disaggregate is not None:
        # each param goes straight to its final sharding (never whole onto one device)
        from akv_jax.serving.executor import load_placement

        placement = load_placement(args.tp, args.disaggregate)
    try:
        model = load_model(
            args.model_path, args.dtype, progress=sys.stderr.isatty(),
            moe_weight_format=args.moe_weight_format, placement=placement,
        )
    except Exception as e:  # any loader failure is a user-facing "cannot load" line
        log.debug("model load failed", exc_info=True)
        raise StartupError(f"cannot load {what}: {e}") from None
    if args.context_length is not None:
        is_tiny = args.model_path in TINY_MODELS
        model = with_context_length(model, args.context_length, is_tiny)
    try:
        engine = Engine(
            model,
            max_total_tokens=args.max_total_tokens,
            page_size=args.page_size,
            attention_backend=args.attention_backend,
            max_running=args.max_running_requests,
            prefill_chunk=args.prefill_chunk,
            tp=args.tp,
            disaggregate=args.disaggregate,
            host_kv_tokens=args.host_kv_tokens,
            admission_window_s=args.admission_window_s,
            admission_max_wait_s=args.admission_max_wait_s,
            overlap=not args.disable_overlap_schedule,
            deterministic=args.deterministic,
        )
        # The groups hold the weights in their own layouts (placed, sharded, or repacked for
        # the CPU's kernels): free the loaded copy.
        import dataclasses

        model = dataclasses.replace(model, params=engine.executor.decode.params)
        if not args.skip_warmup:
            # every process of a multi-host run warms up alike, in step
            warmup(engine, args.warmup_shapes)
        if args.num_processes > 1:
            from akv_jax.serving.multihost import check_replicas

            engine.replica_check = check_replicas  # on every process, from the first request
    except Exception as e:
        log.debug("engine start failed", exc_info=True)
        raise StartupError(f"cannot start the engine for {what}: {e}") from None
    return model, engine


def with_context_length(model, n: int, is_tiny: bool):
    """``model`` with position limit ``n`` (StartupError past a real model's own limit: its
    RoPE was never trained there; the random tiny model has nothing to lose)."""
    import dataclasses

    own = model.cfg.max_position_embeddings
    if n > own and not is_tiny:
        raise StartupError(
            f"--context-length {n} is above the model's max_position_embeddings ({own})",
            EXIT_USAGE,
        )
    return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, max_position_embeddings=n))


def build_server(
    args: argparse.Namespace, sock: socket.socket, model, engine, lockstep: bool = False
) -> ReadyServer:
    """The uvicorn server around a started engine."""
    from akv_jax.serving.api import create_app
    from akv_jax.serving.async_engine import AsyncEngine
    from akv_jax.serving.protocol import Limits

    name = args.served_model_name or served_name(args.model_path)
    limits = Limits(max_new_tokens=args.max_new_tokens_limit,
                    reasoning_budget=args.reasoning_budget)
    async_engine = AsyncEngine(engine, lockstep=lockstep)
    app = create_app(
        async_engine, name, model.tokenizer, args.api_key, limits,
        vocab_size=model.cfg.vocab_size,
        max_position=model.cfg.max_position_embeddings,
        stop_ids=model.stop_ids,
        arch=model.cfg.arch,
        reply_format=args.reply_format,
    )
    config = uvicorn.Config(
        app, log_level=args.log_level, access_log=args.log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    server = ReadyServer(config, f"akv_jax serving {name} on {_url(sock, args.host)}")
    server.async_engine = async_engine
    # An engine that stopped for good (see AsyncEngine) takes the server down with it, so a
    # supervisor restarts it instead of it answering errors forever.
    async_engine.on_fatal = lambda _msg: setattr(server, "should_exit", True)
    return server


class ReadyServer(uvicorn.Server):
    """uvicorn's server, printing one line once it accepts connections."""

    def __init__(self, config: uvicorn.Config, ready_line: str):
        super().__init__(config)
        self.ready_line = ready_line
        self.async_engine = None  # set by build_server; its ``failure`` ends main() with 1

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.ready_line, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    multi = args.num_processes > 1
    try:
        if multi:
            init_distributed(args)
        check_args(args)
        if multi and args.process_id != 0:
            _, engine = build_engine(args)
            return run_follower(engine)
        sock = bind_socket(args.host, args.port)
        model, engine = build_engine(args)
        server = build_server(args, sock, model, engine, lockstep=multi)
    except StartupError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        if multi:
            _exit_now(e.code)  # a stuck peer would hold jax's shutdown barrier for minutes
        return e.code
    except KeyboardInterrupt:
        return 130
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn re-raises Ctrl-C after its graceful shutdown; that shutdown is the clean end.
        pass
    failure = server.async_engine.failure if server.async_engine is not None else None
    if failure is not None:
        print(f"{PROG}: error: {failure}", file=sys.stderr)
        if multi:
            _exit_now(EXIT_FAILURE)
        return EXIT_FAILURE
    return 0


def run_follower(engine: Engine) -> int:
    """Processes 1..N-1 of a multi-host run: mirror the leader until it stops (0), or exit
    with one line when the leader is lost or the engines diverge (1)."""
    from akv_jax.serving.multihost import MultihostError, follower_loop

    try:
        follower_loop(engine)  # returns when process 0 shuts down
    except MultihostError as e:
        print(f"{PROG}: error: process {_process_index()}: {e}", file=sys.stderr)
        _exit_now(EXIT_FAILURE)
    return 0


def _process_index() -> int:
    import jax

    return jax.process_index()


def _exit_now(code: int) -> None:
    """Exit without jax.distributed's shutdown barrier: with a peer gone it would wait for
    minutes and then abort the process with a stack trace instead of our one line."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
