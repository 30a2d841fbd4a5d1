"""One prepared check of akv_jax on a GPU, and of its own plumbing on the CPU (``--cpu``).

    bash scripts/device_check.sh [--cpu] [--parts "kernels engine"]   # what to run
    python bench/device_check.py --part NAME [--cpu] [--out DIR] [--budget-s S]
    python bench/device_check.py --summary [--out DIR] [--rc NAME=CODE ...]

scripts/device_check.sh runs each part in its own process under its own timeout, kernels
first, then prints the summary. A part writes ``DIR/<part>.json`` after every check, so one
killed by its timeout leaves what it finished. docs/device_check.md says how to run it on a
lent GPU and what each part costs.

* ``kernels``: segment attention (decode, prefill and one-pass restore batches; SmolLM2,
  Qwen3-8B and GPT-OSS head layouts, GPT-OSS with sinks and its sliding window) and repos,
  float32 and bfloat16, made by :mod:`akv_jax.pallas.dispatch` as the server makes them,
  against the jnp references computed at "highest" matmul precision. Pool slots no segment
  may read (and pages repos must not touch) hold NaN, so a stray read shows. A float32
  mismatch on a GPU is retried at "highest" precision: TF32 rounding or a wrong kernel.
* ``engine``: every akv_jax module imported with this jax (a missing third-party package
  listed, not failed); the serving engine on ``tiny``, ``tiny-gpt-oss`` and
  ``tiny-qwen3-moe`` against the dense float64 reference on random op histories
  (tests/exactness.py: its histories, answers and comparison), sent serially, reversed and
  all at once through a pool that forces eviction and one-pass restores, and for ``tiny``
  through the host tier. A mismatch on a GPU is retried at "highest" matmul precision.
* ``bits``: ``--deterministic`` on ``tiny`` (tied head): a request with drops and repos amid
  a batch, beside a sliced prompt and from the cache, its log-prob bits ``==`` its own
  alone (tests/bitwise_cases.py); on a GPU the default mode's differing bits beside it.
* ``bandwidth``: decode attention at SmolLM2, Qwen3-8B and GPT-OSS-120B (one TP4 shard's
  heads) shapes, bfloat16: achieved HBM bandwidth (the bytes the batch must move, over the
  time of a call) as a fraction of the device's peak.
* ``peer``: torch's ``scaled_dot_product_attention`` on the same shapes (contiguous KV),
  timed and counted the same way, in a process without jax; skipped where torch is absent.
* ``step``: the server's decode step (:class:`akv_jax.serving.device_group.DeviceGroup`) at
  GPT-OSS-20B's shapes with random bfloat16 weights, 16 requests over 4,096-token views:
  tokens/s against the roofline estimate of :mod:`akv_jax.aot.step_compiles` (bench/aot.py's).

``--cpu``: the same code on small shapes, Pallas in interpret mode; timings mean nothing
there, the point is that every path runs before device time is spent on it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import platform
import site
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from common import median_seconds, tests_module

ROOT = Path(__file__).resolve().parents[1]
# The device image has akv_jax's tree, not an install of it: scripts/device_check.sh puts the
# tree on PYTHONPATH. Carried wheels go after the image's own packages (a site directory).
if os.environ.get("AKV_DEVICE_SITE"):
    site.addsitedir(os.environ["AKV_DEVICE_SITE"])

from akv_jax.aot.targets import TARGETS, Target  # noqa: E402  (data only: no jax)

PARTS = ("kernels", "engine", "bits", "bandwidth", "peer", "step")
DEFAULT_OUT = ROOT / ".device_check"
PAGE_SIZE = 16  # the server's default --page-size
TOL = {"f32": 1e-5, "bf16": 2e-2}  # tests/pallas_cases.py's
# A part starts no new check past this share of its budget (its timeout kills it at 100%).
BUDGET_SHARE = 0.9
# bandwidth: (requests, context) per layout on a GPU, ~0.3-0.5 GB of KV read per call.
BANDWIDTH_SHAPES = {"SmolLM2-135M": (64, 8192), "Qwen3-8B": (16, 8192),
                    "GPT-OSS-120B": (32, 16384)}
BANDWIDTH_TP = {"GPT-OSS-120B": 4}  # the paper's setup: the heads of one TP4 shard
TARGET_HBM_FRACTION = 0.7  # DESIGN §5: decode attention at 70% of HBM bandwidth or more
ENGINE_MODELS = ("tiny", "tiny-gpt-oss", "tiny-qwen3-moe")


class Skip(Exception):
    """A check that cannot run here: reported as skipped, with its reason."""


# ---------------------------------------------------------------------------------------
# Pure logic: devices, statuses, the summary (tests/test_device_check.py)


def device_target(device_kind: str) -> Target | None:
    """The target (data-sheet peaks) whose name the device's name contains: ``NVIDIA H200``
    is the H200 (4.8 TB/s), ``NVIDIA H100 80GB HBM3`` the H100 (3.35 TB/s); an A100 has the
    A800's figures. None for anything else (the CPU)."""
    kind = device_kind.upper()
    aliases = {"A100": "A800"}
    for name in sorted([*TARGETS, *aliases], key=len, reverse=True):
        target = TARGETS[aliases.get(name, name)]
        if target.platform == "cuda" and name.upper() in kind:
            return target
    return None


def compare(got: Any, want: Any, tol: float) -> dict:
    """``{"ok", "max_abs_err", "nan"}`` of ``got`` against ``want`` (numpy-convertible):
    ok when nothing is NaN and ``|got - want| <= tol + tol * |want|`` everywhere."""
    import numpy as np

    g = np.asarray(got, np.float32)
    w = np.asarray(want, np.float32)
    nan = int(np.isnan(g).sum())
    err = np.abs(g - w)
    max_err = float(np.nanmax(err)) if err.size else 0.0
    ok = nan == 0 and bool(np.all(err <= tol + tol * np.abs(w)))
    return {"ok": ok, "max_abs_err": max_err, "nan": nan}


def decode_bytes(kv_slots: int, rows: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 itemsize: int) -> int:
    """HBM bytes a decode attention call must move: K and V of every slot read, and q and
    the output of every query row."""
    return (2 * kv_slots * num_kv_heads + 2 * rows * num_heads) * head_dim * itemsize


def time_per_call(call: Callable[[], Any], sync: Callable[[Any], Any], iters: int,
                  rounds: int = 3) -> float:
    """Median over ``rounds`` of the mean seconds per call of ``iters`` back-to-back calls,
    synced once per round (so the device queue stays full and host dispatch hides), after a
    warm-up call that compiles."""
    sync(call())

    def burst() -> None:
        out = None
        for _ in range(iters):
            out = call()
        sync(out)

    return median_seconds(burst, rounds, warm=False) / iters


def exit_reason(rc: int | None) -> str:
    if rc is None:
        return "was not run"
    if rc == -1:
        return "was not started: the run's time budget was spent"
    if rc in (124, 137):
        return f"timed out (exit {rc}): its checks after the last one recorded did not run"
    return f"exited with {rc} before it finished"


def load_parts(out: Path, rcs: dict[str, int]) -> list[dict]:
    """Every part's JSON from ``out``; a part that did not finish gets one more check saying
    so (failed, or skipped when it never started)."""
    parts = []
    for name in PARTS:
        path = out / f"{name}.json"
        data = json.loads(path.read_text()) if path.exists() else None
        if data is None and name not in rcs:
            continue  # not asked for in this run
        data = data or {"part": name, "meta": {}, "checks": [], "complete": False}
        if not data.get("complete"):
            rc = rcs.get(name)
            why = f"the {name} part {exit_reason(rc)}"
            status, field = ("skip", "reason") if rc == -1 else ("fail", "error")
            data["checks"].append({"name": f"{name}: part finished", "status": status,
                                   field: why})
        parts.append(data)
    return parts


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def summary_line(parts: list[dict], seconds: float | None = None) -> str:
    """The one line the run ends with: checks passed, where, and the headline figures."""
    checks = [c for p in parts for c in p["checks"]]
    n_pass = sum(c["status"] == "pass" for c in checks)
    n_fail = sum(c["status"] == "fail" for c in checks)
    skipped = [c for c in checks if c["status"] == "skip"]
    meta = next((p["meta"] for p in parts if p.get("meta")), {})
    cpu = meta.get("platform", "cpu") == "cpu"
    where = "cpu" if cpu else meta.get("device", "?")
    line = (f"device_check: {n_pass}/{n_pass + n_fail} checks pass on {where} "
            f"(jax {meta.get('jax', '?')}{', Pallas interpreted' if cpu else ''})")
    if skipped:
        reasons = sorted({c.get("reason", "?") for c in skipped})
        line += f"; {len(skipped)} skipped ({'; '.join(reasons)})"
    by_name = {c["name"]: c for c in checks}
    if cpu:
        timed = [n for n, c in by_name.items()
                 if n.startswith(("bandwidth", "step")) and c["status"] == "pass"]
        if timed:
            line += f"; {len(timed)} timed checks ran (their timings mean nothing on cpu)"
    else:
        line += bandwidth_figures(by_name) + step_figures(by_name)
    if seconds is not None:
        line += f"; {seconds:.0f} s"
    return line


def bandwidth_figures(by_name: dict[str, dict]) -> str:
    """"; decode attention HBM <layout> <fraction> (peer <fraction>), ... of <peak> GB/s"."""
    bw = [(n.split(" ", 1)[1].rsplit(" ", 1)[0], c) for n, c in by_name.items()
          if n.startswith("bandwidth ") and n.endswith(" kernel") and c["status"] == "pass"]
    if not bw:
        return ""
    parts = []
    for label, c in bw:
        peer = by_name.get(f"bandwidth {label} peer", {})
        parts.append(f"{label} {_pct(c.get('hbm_fraction'))}" + (
            f" (peer {_pct(peer.get('hbm_fraction'))})" if peer.get("status") == "pass" else ""))
    return f"; decode attention HBM {', '.join(parts)} of {bw[0][1].get('peak_gbps')} GB/s"


def step_figures(by_name: dict[str, dict]) -> str:
    step = by_name.get("step GPT-OSS-20B decode")
    if not step or step["status"] != "pass":
        return ""
    return (f"; GPT-OSS-20B decode step {step['tokens_per_s']:.0f} tok/s, "
            f"{_pct(step.get('roofline_fraction'))} of its roofline "
            f"({step['roofline_tokens_per_s']:.0f} tok/s)")


# ---------------------------------------------------------------------------------------
# Recording


def error_text(e: BaseException) -> str:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return f"{type(e).__name__}: {str(e).strip()[:2000]}\n" + "".join(tb[-4:])[-3000:]


class Part:
    """One part's checks, written to ``out/<name>.json`` after each (atomically)."""

    def __init__(self, name: str, out: Path, meta: dict, budget_s: float):
        self.name = name
        self.path = out / f"{name}.json"
        self.meta = meta
        self.budget_s = budget_s
        self.t0 = time.monotonic()
        self.checks: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)
        self.write(complete=False)

    def write(self, complete: bool) -> None:
        data = {"part": self.name, "meta": self.meta, "checks": self.checks,
                "complete": complete, "seconds": round(time.monotonic() - self.t0, 2)}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def check(self, name: str, fn: Callable[[], dict | None]) -> dict:
        """Run one check: ``fn`` returns its figures (``ok: False`` fails it), raises
        :class:`Skip` (or misses a module) to skip it, or raises anything else to fail it."""
        t = time.monotonic()
        if t - self.t0 > BUDGET_SHARE * self.budget_s:
            info, status = {"reason": f"the {self.name} part's budget was spent"}, "skip"
        else:
            try:
                info = dict(fn() or {})
                status = "pass" if info.pop("ok", True) else "fail"
            except Skip as e:
                info, status = {"reason": str(e)}, "skip"
            except ModuleNotFoundError as e:
                info, status = {"reason": f"module {e.name} is not installed"}, "skip"
            except Exception as e:  # the check's verdict, not the script's
                info, status = {"error": error_text(e)}, "fail"
        rec = {"name": name, "status": status, "seconds": round(time.monotonic() - t, 2), **info}
        self.checks.append(rec)
        self.write(complete=False)
        note = rec.get("reason") or (rec.get("error", "").splitlines() or [""])[0]
        print(f"  {status:4s} {name} ({rec['seconds']:.1f} s){': ' + note if note else ''}",
              flush=True)
        return rec


def environment(cpu: bool) -> dict:
    """What ran: Python, jax and its devices (the image's jax, whatever its version)."""
    import jax

    dev = jax.devices()[0]
    return {
        "python": platform.python_version(), "jax": jax.__version__,
        "jaxlib": getattr(importlib.import_module("jaxlib"), "__version__", "?"),
        "platform": jax.default_backend(), "device": dev.device_kind,
        "devices": jax.device_count(), "cores": getattr(dev, "core_count", None),
        "mode": "Pallas interpreted" if cpu else "compiled", "host": platform.node(),
    }


def torch_environment(cpu: bool) -> dict:
    """The peer part's: torch's version and device (no jax in that process)."""
    try:
        import torch
    except ImportError:
        torch = None
    cuda = torch is not None and torch.cuda.is_available() and not cpu
    return {"python": platform.python_version(), "torch": getattr(torch, "__version__", None),
            "platform": "gpu" if cuda else "cpu",
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "mode": "torch" if torch else "no torch", "host": platform.node()}


def backend_for(cpu: bool) -> str:
    """The attention backend flag: the server's default on a device; on the CPU "pallas",
    whose GPU kernel body runs interpreted."""
    return "pallas" if cpu else "auto"


def gpu_path(cpu: bool) -> dict:
    """What :func:`akv_jax.pallas.dispatch.resolve_backend` (the server's choice) picks; on a
    device anything but the compiled GPU kernel fails the check that asked."""
    from akv_jax.pallas.dispatch import resolve_backend

    impl, interpret = resolve_backend(backend_for(cpu))
    if not cpu and (impl, interpret) != ("gpu", False):
        raise RuntimeError(f"the server would run {impl!r} (interpret={interpret}) here, "
                           "not the Pallas GPU kernel")
    return {"backend": backend_for(cpu), "implementation": impl, "interpret": interpret}


# ---------------------------------------------------------------------------------------
# Part 1: kernels


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sinks: bool
    window: int | None

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def layout(model: str, cpu: bool, tp: int = 1) -> Layout:
    """A preset's attention layout (one ``tp`` shard's heads). On the CPU one kv head (the
    interpreted grid runs per head) and a window that the small views reach past."""
    from akv_jax.model.presets import preset_config

    cfg = preset_config(model)
    hkv = 1 if cpu else cfg.num_kv_heads // tp
    window = cfg.sliding_window or None
    if cpu and window:
        window = 16
    return Layout(model, hkv * (cfg.num_heads // cfg.num_kv_heads), hkv, cfg.head_dim,
                  bool(cfg.attention_sinks), window)


def kernel_case(phase: str, cpu: bool, seed: int) -> Any:
    """A decode, prefill or restore batch (tests/pallas_cases.py) at the server's block sizes
    on a device, small on the CPU. Decode has a request that sees nothing (its row must be
    zeros, not NaN)."""
    import numpy as np

    from akv_jax.serving.executor import PREFILL_BLOCK_Q

    cases = tests_module("pallas_cases")
    rng = np.random.default_rng(seed)
    block_q = 16 if cpu else PREFILL_BLOCK_Q
    if phase == "decode":
        lens = ([1, 37, 70, 20] if cpu else
                [1, 37, 4096, 3000, 2048, 1500, 4095, 700, 64, 2500, 4096, 100, 1024, 333,
                 3900, 2000])
        case = cases.decode_case(rng, lens, page_size=PAGE_SIZE, drop_fraction=0.25,
                                 span=8 if cpu else 48)
        blind = case.specs[-1]
        case.specs[-1] = dataclasses.replace(blind, kv_visible=np.zeros_like(blind.kv_visible))
        return case
    if phase == "prefill":
        cached, new = (40, 24) if cpu else (1536, 512)
        return cases.prefill_case(rng, cached, new, page_size=PAGE_SIZE, block_q=block_q,
                                  drop_fraction=0.25, span=8 if cpu else 40)
    lens = (6, 10, 5, 8, 7) if cpu else (256, 512, 256, 384, 256)
    return cases.restore_case(rng, lens, page_size=PAGE_SIZE, block_q=block_q)


DTYPES = ("f32", "bf16")


def jnp_dtype(name: str) -> Any:
    import jax.numpy as jnp

    return {"f32": jnp.float32, "bf16": jnp.bfloat16}[name]


def attention_check(lay: Layout, phase: str, dtype: str, cpu: bool) -> dict:
    """The dispatched kernel against the reference on a NaN-poisoned pool."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from akv_jax.pallas.dispatch import make_attention_fn
    from akv_jax.pallas.reference import segment_attention_reference

    info = gpu_path(cpu)
    cases = tests_module("pallas_cases")
    case = kernel_case(phase, cpu, seed=1)
    rng = np.random.default_rng(2)
    key = rng if cpu else jax.random.key(2)
    q, k, v, batch = cases.materialize(case, key, num_kv_heads=lay.num_kv_heads,
                                       group=lay.group, head_dim=lay.head_dim,
                                       dtype=jnp_dtype(dtype), nan_fill=True)
    sinks = jnp.asarray(rng.uniform(-1, 2, lay.num_heads), jnp.float32) if lay.sinks else None
    common = dict(block_q=case.block_q, sm_scale=lay.head_dim**-0.5,
                  sliding_window=lay.window)
    attention = make_attention_fn(backend_for(cpu), **common)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(functools.partial(segment_attention_reference, **common))(
            q, k, v, batch, sinks=sinks)
    got = attention(q, k, v, batch, sinks=sinks)
    info.update(compare(got, want, TOL[dtype]), rows=int(q.shape[0]),
                pool_pages=int(k.shape[0]), window=lay.window, sinks=lay.sinks)
    if phase == "decode":  # the blind request's row: exact zeros
        blind = np.asarray(got[len(case.specs) - 1], np.float32)
        info["blind_row_zero"] = bool(np.all(blind == 0))
        info["ok"] = info["ok"] and info["blind_row_zero"]
    if not info["ok"] and dtype == "f32" and not cpu:
        with jax.default_matmul_precision("highest"):  # TF32 in the kernel's dots?
            info["at_highest_precision"] = compare(attention(q, k, v, batch, sinks=sinks),
                                                   want, TOL[dtype])
    return info


def repos_check(model: str, dtype: str, cpu: bool) -> dict:
    """The dispatched repos kernel against the reference: listed pages re-rotated, every
    other page (NaN-filled) bit for bit untouched, padding entries ignored."""
    import jax.numpy as jnp
    import numpy as np

    from akv_jax.model.presets import preset_config
    from akv_jax.model.rope import rope_table_for
    from akv_jax.pallas.dispatch import make_repos_fn
    from akv_jax.pallas.reference import repos_reference

    info = gpu_path(cpu)
    cfg = preset_config(model)
    table = rope_table_for(cfg)
    hkv = 1 if cpu else cfg.num_kv_heads
    P, n = (12, 5) if cpu else (1024, 64)
    rng = np.random.default_rng(3)
    listed = rng.choice(P, n - 2, replace=False)
    pages = np.r_[listed, P, P + 3].astype(np.int32)  # the last two: padding entries
    pool = rng.standard_normal((P, PAGE_SIZE, hkv, cfg.head_dim), np.float32)
    unlisted = np.setdiff1d(np.arange(P), listed)
    pool[unlisted] = np.nan
    k = jnp.asarray(pool, jnp_dtype(dtype))
    old, new = (jnp.asarray(rng.integers(0, cfg.max_position_embeddings, (n, PAGE_SIZE)),
                            jnp.int32) for _ in range(2))
    got = make_repos_fn(backend_for(cpu))(k, jnp.asarray(pages), old, new, table)
    want = repos_reference(k, jnp.asarray(pages), old, new, table)
    info.update(compare(np.asarray(got)[listed], np.asarray(want)[listed], TOL[dtype]),
                pool_pages=P, listed=int(n - 2))
    bits = np.uint16 if jnp.dtype(k.dtype).itemsize == 2 else np.uint32
    same = np.array_equal(np.asarray(got)[unlisted].view(bits),
                          np.asarray(k)[unlisted].view(bits))
    info["unlisted_untouched"] = bool(same)
    info["ok"] = info["ok"] and same
    return info


def run_kernels(part: Part, cpu: bool) -> None:
    """Repos first (quick), then attention phase by phase, so that a part cut short by its
    budget has still seen every layout at decode."""
    from akv_jax.aot.kernel_compiles import KERNEL_LAYOUTS, PHASES

    for model in KERNEL_LAYOUTS:
        for dtype in DTYPES:
            part.check(f"repos {model} {dtype}", functools.partial(repos_check, model, dtype, cpu))
    for phase in PHASES:
        for model in KERNEL_LAYOUTS:
            lay = layout(model, cpu)
            extras = "+sinks+window" if lay.sinks else ""
            for dtype in DTYPES:
                part.check(f"attention {model} {phase} {dtype}{extras}",
                           functools.partial(attention_check, lay, phase, dtype, cpu))


# ---------------------------------------------------------------------------------------
# Part 2: the serving engine against the dense reference


def imports_check() -> dict:
    """Import every module of akv_jax and converters with this Python's jax: a module whose
    third-party package is missing here is listed under it (the engine needs none of them),
    any other import error fails the check (e.g. a jax API this jax lacks)."""
    import pkgutil

    missing: dict[str, list[str]] = {}
    failed: dict[str, str] = {}
    imported = 0
    for top in ("akv_jax", "converters"):
        package = importlib.import_module(top)
        for mod in pkgutil.walk_packages(package.__path__, f"{top}.", onerror=lambda _: None):
            if mod.name.endswith("__main__"):  # a CLI: importing it runs it
                continue
            try:
                importlib.import_module(mod.name)
                imported += 1
            except ModuleNotFoundError as e:
                root = (e.name or "?").split(".")[0]
                if root in ("akv_jax", "converters"):
                    failed[mod.name] = f"ModuleNotFoundError: {e}"
                else:
                    missing.setdefault(root, []).append(mod.name)
            except Exception as e:
                failed[mod.name] = f"{type(e).__name__}: {e}"[:400]
    return {"ok": not failed, "imported": imported, "failed": failed,
            "missing_packages": missing}


def tiny_model(name: str) -> SimpleNamespace:
    """``--model-path NAME``'s config and random weights (converters.loading draws them the
    same way, seed 0), without a tokenizer: the engine takes token ids."""
    from akv_jax.model.params import seeded_params
    from akv_jax.model.presets import tiny_config, tiny_gpt_oss_config, tiny_qwen3_moe_config

    configs = {"tiny": tiny_config, "tiny-gpt-oss": tiny_gpt_oss_config,
               "tiny-qwen3-moe": tiny_qwen3_moe_config}
    cfg = configs[name]()
    return SimpleNamespace(cfg=cfg, params=seeded_params(cfg, 0), tokenizer=None)


def request_orders(model: Any, reqs: list, refs: list, backend: str, n_new: int, seed: int,
                   host_tier: bool) -> dict:
    """tests/exactness.py's protocol, shortened to fit the device budget: every request
    serially, reversed (extensions before their bases), then three copies of each at once,
    through a pool of one largest request (evictions and one-pass restores); with
    ``host_tier``, one arrival a step through a host tier that holds everything evicted."""
    import numpy as np

    from akv_jax.serving.engine import Engine

    ex = tests_module("exactness")
    rng = np.random.default_rng(seed)
    n, ps = len(reqs), 4
    tokens = ex.pool_that_forces_eviction(reqs, ps, 1, n_new)
    bad: list[str] = []

    def phases(engine: Any, plan: Iterable[tuple[str, list[int], bool | int]]) -> dict:
        for label, order, concurrent in plan:
            got = ex.run_requests(engine, reqs, order, concurrent, n_new)
            bad.extend(f"{label}: {m}" for m in ex.mismatches(refs, order, got))
        stats = engine.stats()
        if not (engine.flush_cache() and engine.cache.pool.used_pages == 0):
            bad.append("pages leaked: the pool was not empty after a flush")
        return stats

    small = Engine(model, max_total_tokens=tokens, page_size=ps, attention_backend=backend,
                   host_kv_tokens=0)
    stats = phases(small, [("serial", list(range(n)), False),
                           ("reversed", list(range(n))[::-1], False),
                           ("concurrent", list(rng.permutation(ex.REPEATS * n) % n), True)])
    if host_tier:
        tiered = Engine(model, max_total_tokens=tokens, page_size=ps,
                        attention_backend=backend, host_kv_tokens=64 * tokens)
        tier = phases(tiered, [("host tier, one arrival a step", list(rng.permutation(n)), 1)])
        stats.update({f"{k}[host tier]": v for k, v in tier.items()})
    keep = ("evictions", "restores", "dead_evictions", "offloaded_pages[host tier]",
            "reloaded_pages[host tier]")
    return {"ok": not bad, "mismatches": bad[:12], "mismatch_count": len(bad),
            "requests": n, "new_tokens": n_new, "pool_tokens": tokens,
            **{k: stats[k] for k in keep if k in stats}}


def engine_check(name: str, cpu: bool, precision: str | None = None) -> dict:
    """One tiny model through :func:`request_orders` on the server's attention backend."""
    import jax
    import numpy as np

    from akv_jax.cache.dense_reference import DenseModel

    info = gpu_path(cpu)
    ex = tests_module("exactness")
    model = tiny_model(name)
    dm = DenseModel(model.params, model.cfg)
    count, n_new = (3, 4) if cpu else (6, ex.N_NEW)
    reqs = ex.random_histories(np.random.default_rng(11), count, vocab=model.cfg.vocab_size,
                               answer=ex.reference_answer(dm))
    refs = ex.dense_answers(dm, reqs, n_new)
    scope = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
    with scope:
        info.update(request_orders(model, reqs, refs, backend_for(cpu), n_new, seed=7,
                                   host_tier=name == "tiny"))
    return info


def run_engine(part: Part, cpu: bool) -> None:
    """On a GPU a failing model is run again at "highest" matmul precision (TF32 rounding,
    or a wrong answer?): the first at once, the others after every model had its turn."""
    part.check("imports akv_jax, converters", imports_check)
    failed = []
    for name in ENGINE_MODELS:
        rec = part.check(f"engine {name}", functools.partial(engine_check, name, cpu))
        if rec["status"] == "fail" and not cpu:
            failed.append(name)
            if len(failed) == 1:
                rerun_highest(part, name, cpu)
    for name in failed[1:]:
        rerun_highest(part, name, cpu)


def rerun_highest(part: Part, name: str, cpu: bool) -> None:
    part.check(f"engine {name} (matmul precision highest)",
               functools.partial(engine_check, name, cpu, "highest"))


# ---------------------------------------------------------------------------------------
# Part: bits (--deterministic)

# The situations tests/bitwise_cases.py runs a probe in; on the CPU only the first (budget).
BITS_SITUATIONS = ("amid 7 decoding when it arrives", "beside a long prompt in slices",
                   "from the cache")


def bits_check(cpu: bool, deterministic: bool) -> dict:
    """tests/bitwise_cases.py's probe (drops and repos, 12 greedy log-probs) on ``tiny``
    with a tied head, in each situation against itself alone on a fresh engine: tokens
    equal and float32 bits ``==`` with ``deterministic`` (the fixed-tile projections and
    the unsplit attention); without it a GPU's differing bits are counted, not failed."""
    info = gpu_path(cpu)
    bc = tests_module("bitwise_cases")
    tiny = bc.setup("qwen3", tied=True, attention_backend=backend_for(cpu),
                    deterministic=deterministic)
    probe = bc.PROBES["drops+repos"]
    want_toks, want_lps = bc.drive(bc.engine(tiny), {0: [bc.probe_request(probe)]})
    differing, same_tokens = {}, True
    for name in BITS_SITUATIONS[:1] if cpu else BITS_SITUATIONS:
        toks, lps = bc.SCENARIOS[name](tiny, probe)
        same_tokens &= toks == want_toks
        differing[name] = int((bc.bits(lps) != bc.bits(want_lps)).sum())
    ok = same_tokens and not any(differing.values()) if deterministic else True
    return {**info, "ok": ok, "deterministic": deterministic, "same_tokens": same_tokens,
            "log_probs": len(want_lps), "differing_bits": differing}


def run_bits(part: Part, cpu: bool) -> None:
    part.check("bits tiny --deterministic", functools.partial(bits_check, cpu, True))
    if not cpu:  # the CPU is bitwise in every mode; a GPU's default mode, for comparison
        part.check("bits tiny (default mode)", functools.partial(bits_check, cpu, False))


# ---------------------------------------------------------------------------------------
# Part 3: decode attention bandwidth, beside a peer


def bandwidth_shape(model: str, cpu: bool) -> tuple[Layout, int, int]:
    """(layout, requests, context): one TP shard's heads where the paper shards."""
    lay = layout(model, cpu, BANDWIDTH_TP.get(model, 1))
    requests, context = (2, 64) if cpu else BANDWIDTH_SHAPES[model]
    return dataclasses.replace(lay, window=None), requests, context  # a full-attention layer


def label_of(model: str) -> str:
    return f"{model} TP{BANDWIDTH_TP[model]}" if model in BANDWIDTH_TP else model


def peak(device_kind: str | None) -> tuple[Target | None, dict]:
    """The device's target and its figures for the JSON (None on the CPU)."""
    target = device_target(device_kind) if device_kind else None
    return target, {"target": target.name if target else None,
                    "peak_gbps": target.hbm_bytes_per_s / 1e9 if target else None}


def jax_device_kind(cpu: bool) -> str | None:
    import jax

    return None if cpu else jax.devices()[0].device_kind


def bandwidth_check(model: str, cpu: bool) -> dict:
    """The dispatched decode attention over every request's whole view, timed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from akv_jax.pallas.dispatch import make_attention_fn

    info = gpu_path(cpu)
    lay, requests, context = bandwidth_shape(model, cpu)
    cases = tests_module("pallas_cases")
    rng = np.random.default_rng(4)
    case = cases.decode_case(rng, [context] * requests, page_size=PAGE_SIZE)
    q, k, v, batch = cases.materialize(case, rng if cpu else jax.random.key(4),
                                       num_kv_heads=lay.num_kv_heads, group=lay.group,
                                       head_dim=lay.head_dim, dtype=jnp.bfloat16,
                                       nan_fill=False)
    sinks = jnp.zeros((lay.num_heads,), jnp.float32) if lay.sinks else None
    attention = make_attention_fn(backend_for(cpu), block_q=1, sm_scale=lay.head_dim**-0.5)
    fn = jax.jit(lambda q, k, v, b, s: attention(q, k, v, b, sinks=s))
    secs = time_per_call(lambda: fn(q, k, v, batch, sinks), jax.block_until_ready,
                         iters=2 if cpu else 50)
    out = fn(q, k, v, batch, sinks)
    nbytes = decode_bytes(cases.visible_pages(case) * PAGE_SIZE, requests, lay.num_heads,
                          lay.num_kv_heads, lay.head_dim, 2)
    target, figures = peak(jax_device_kind(cpu))
    gbps = nbytes / secs / 1e9
    info.update(figures, layout=dataclasses.asdict(lay), requests=requests, context=context,
                ms=secs * 1e3, gbps=gbps, bytes=nbytes,
                hbm_fraction=gbps * 1e9 / target.hbm_bytes_per_s if target else None,
                ok=not bool(jnp.isnan(out[:requests].astype(jnp.float32)).any()))
    if target:
        info["meets_target"] = info["hbm_fraction"] >= TARGET_HBM_FRACTION
    return info


def peer_check(model: str, cpu: bool) -> dict:
    """torch's scaled_dot_product_attention on the same shapes (KV contiguous per request,
    no sinks), timed the same way."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        raise Skip(f"peer unavailable: torch does not import ({e})") from None
    cuda = torch.cuda.is_available() and not cpu
    if not cpu and not cuda:
        raise Skip("peer unavailable: torch sees no CUDA device")
    lay, requests, context = bandwidth_shape(model, cpu)
    dev = "cuda" if cuda else "cpu"
    q = torch.randn(requests, lay.num_heads, 1, lay.head_dim, dtype=torch.bfloat16, device=dev)
    k, v = (torch.randn(requests, lay.num_kv_heads, context, lay.head_dim,
                        dtype=torch.bfloat16, device=dev) for _ in range(2))
    try:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        call, gqa = (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)), "native"
    except TypeError:  # torch < 2.5: the kv heads repeated (the peer then reads more)
        kx, vx = (t.repeat_interleave(lay.group, dim=1) for t in (k, v))
        call, gqa = (lambda: F.scaled_dot_product_attention(q, kx, vx)), "repeated kv heads"
    sync = (lambda _: torch.cuda.synchronize()) if cuda else (lambda _: None)
    secs = time_per_call(call, sync, iters=2 if cpu else 50)
    nbytes = decode_bytes(requests * context, requests, lay.num_heads, lay.num_kv_heads,
                          lay.head_dim, 2)
    target, figures = peak(torch.cuda.get_device_name(0) if cuda else None)
    gbps = nbytes / secs / 1e9
    return {"peer": f"torch {torch.__version__} scaled_dot_product_attention", "gqa": gqa,
            **figures, "requests": requests, "context": context, "ms": secs * 1e3,
            "gbps": gbps, "hbm_fraction": gbps * 1e9 / target.hbm_bytes_per_s if target else None}


def run_bandwidth(part: Part, cpu: bool) -> None:
    for model in BANDWIDTH_SHAPES:
        part.check(f"bandwidth {label_of(model)} kernel",
                   functools.partial(bandwidth_check, model, cpu))


def run_peer(part: Part, cpu: bool) -> None:
    """Its own process, without jax: two CUDA stacks in one process is a risk the kernel
    figures need not share."""
    for model in BANDWIDTH_SHAPES:
        part.check(f"bandwidth {label_of(model)} peer", functools.partial(peer_check, model, cpu))


# ---------------------------------------------------------------------------------------
# Part 4: the GPT-OSS-20B-shaped decode step


def random_params(cfg: Any, dtype: Any, seed: int = 0) -> Any:
    """Random weights drawn on the device in ``dtype`` (no float32 copy of a 13 GB expert
    stack): normal(0.02), norms near one, as :func:`akv_jax.model.params.init_params`."""
    import jax

    from akv_jax.model.params import ArrayInfo, Params

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def draw(key: Any, shape: tuple[int, ...], ones: bool) -> Any:
        z = jax.random.normal(key, shape, dtype)
        return (1 + 0.1 * z if ones else 0.02 * z).astype(dtype)

    leaves, treedef = jax.tree.flatten(Params.abstract(cfg),
                                       is_leaf=lambda x: isinstance(x, ArrayInfo))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [draw(k, info.shape, info.init == "ones") for k, info in zip(keys, leaves,
                                                                             strict=True)])


def step_check(cpu: bool) -> dict:
    """The decode step as the executor runs it (DeviceGroup.forward, host inputs each call),
    timed; tokens/s against bench/aot.py's roofline of the same step on this device."""
    import jax
    import jax.numpy as jnp

    from akv_jax.aot.compiler import PAGE_SIZE, roofline_s
    from akv_jax.aot.step_compiles import (
        DECODE_REQUESTS,
        DECODE_VIEW,
        StepCase,
        step_inputs,
        step_traffic,
    )
    from akv_jax.model.forward import make_model_attention
    from akv_jax.model.presets import preset_config, tiny_gpt_oss_config
    from akv_jax.model.rope import rope_table_for
    from akv_jax.serving.device_group import DeviceGroup

    info = gpu_path(cpu)
    real = StepCase("GPT-OSS-20B", 1, "decode", DECODE_REQUESTS * DECODE_VIEW)
    requests, view = (2, 64) if cpu else (DECODE_REQUESTS, DECODE_VIEW)
    case = dataclasses.replace(real, pool_tokens=requests * view)
    cfg = tiny_gpt_oss_config() if cpu else preset_config(real.model)
    inp = step_inputs(case, requests, view)
    backend = backend_for(cpu)
    group = DeviceGroup(cfg, random_params(cfg, jnp.bfloat16), case.pool_tokens // PAGE_SIZE,
                        PAGE_SIZE, jnp.bfloat16, attention_backend=backend)
    attention = make_model_attention(cfg, backend, inp.block_q)
    rope = rope_table_for(cfg)

    def step() -> Any:
        return group.forward(inp.tokens, inp.q_pos, inp.writes, inp.batch, rope, attention,
                             inp.rows)

    secs = time_per_call(step, jax.block_until_ready, iters=1 if cpu else 10)
    # The roofline of the real step, on this device's figures (elsewhere the H200's, for
    # reference: the tiny stand-in's time is no fraction of it).
    flops, nbytes = step_traffic(preset_config(real.model), real)
    target, figures = peak(jax_device_kind(cpu))
    roofline = roofline_s(flops, nbytes, target or TARGETS["H200"])
    info.update(figures, model="tiny-gpt-oss (stand-in)" if cpu else real.model,
                requests=requests, view=view, step_ms=secs * 1e3, tokens_per_s=requests / secs,
                roofline_target=(target or TARGETS["H200"]).name, roofline_ms=roofline * 1e3,
                roofline_tokens_per_s=DECODE_REQUESTS / roofline,
                roofline_fraction=roofline / secs if target else None,
                traffic_gflop=flops / 1e9, traffic_gb=nbytes / 1e9)
    return info


def run_step(part: Part, cpu: bool) -> None:
    part.check("step GPT-OSS-20B decode", functools.partial(step_check, cpu))


RUNNERS = {"kernels": run_kernels, "engine": run_engine, "bits": run_bits,
           "bandwidth": run_bandwidth,
           "peer": run_peer, "step": run_step}


# ---------------------------------------------------------------------------------------
# Command line


def run_part(name: str, out: Path, cpu: bool, budget_s: float) -> int:
    if cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    meta = torch_environment(cpu) if name == "peer" else environment(cpu)
    stack = f"torch {meta['torch']}" if name == "peer" else f"jax {meta['jax']}"
    print(f"device_check {name}: {stack} on {meta['device']} ({meta['platform']}, "
          f"{meta['mode']})", flush=True)
    part = Part(name, out, meta, budget_s)
    RUNNERS[name](part, cpu)
    part.write(complete=True)
    return 0 if all(c["status"] != "fail" for c in part.checks) else 1


def run_summary(out: Path, rcs: dict[str, int], seconds: float | None) -> int:
    parts = load_parts(out, rcs)
    for p in parts:
        for c in p["checks"]:
            if c["status"] != "pass":
                why = c.get("reason") or (c.get("error", "").splitlines() or ["?"])[0]
                print(f"  {c['status']} {c['name']}: {why}")
    line = summary_line(parts, seconds)
    (out / "summary.json").write_text(json.dumps({"line": line, "parts": parts}, indent=1,
                                                 default=str) + "\n")
    print(line, flush=True)
    checks = [c for p in parts for c in p["checks"]]
    ok = any(c["status"] == "pass" for c in checks) and all(c["status"] != "fail"
                                                            for c in checks)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--part", choices=PARTS)
    mode.add_argument("--summary", action="store_true", help="combine the parts' JSON")
    ap.add_argument("--cpu", action="store_true", help="small shapes, Pallas interpreted")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or DEFAULT_OUT))
    ap.add_argument("--budget-s", type=float, default=600.0,
                    help="this part's timeout: no new check starts past 90%% of it")
    ap.add_argument("--rc", nargs="*", default=[], metavar="PART=CODE",
                    help="exit codes of the parts (-1: not started)")
    ap.add_argument("--seconds", type=float, help="the run's wall time, for the summary")
    args = ap.parse_args(argv)
    if args.summary:
        rcs = {k: int(v) for k, v in (item.split("=", 1) for item in args.rc)}
        return run_summary(args.out, rcs, args.seconds)
    return run_part(args.part, args.out, args.cpu, args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
