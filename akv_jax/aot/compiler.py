"""Deviceless compiles for the chips of :mod:`akv_jax.aot.targets`: running the compiler and
reading what it reports.

No accelerator is needed: ``jax.experimental.topologies.get_topology_desc`` describes the
target (a libtpu topology name, or a ``GpuTargetConfigProto`` for a GPU), arguments are
``jax.ShapeDtypeStruct`` with shardings on that topology's devices, and ``.lower().compile()``
runs the real compiler: Mosaic + XLA:TPU (a block too large for VMEM fails), or XLA:GPU with
Triton -> PTX -> cubin (ptxas reports each kernel's registers and spills).

It needs the toolchains of the ``aot`` extra (``bash scripts/aot.sh`` builds ``.venv-aot``):
``jax[tpu]`` (libtpu), ``jax-cuda12-plugin`` + ``jax-cuda12-pjrt`` and ptxas from
``nvidia-cuda-nvcc-cu12``. Two environment variables must be set before jax starts
(:data:`ENV`; :func:`check_env` says which are missing): the CUDA plugin's check for a local
driver/cuDNN is skipped, and XLA logs ptxas' ``-v`` report, which is where registers and
spills come from.

What is compiled: the Pallas kernels (:mod:`akv_jax.aot.kernel_compiles`) and the serving
step (:mod:`akv_jax.aot.step_compiles`). Every figure that is not read from the compiler (step
time) is an *estimate*: a roofline ``max(flops / peak, bytes / bandwidth)`` with the
data-sheet peaks (:func:`roofline_s`). For a kernel, flops and bytes are ``cost_analysis()``'s
(a Pallas call counts its operands' bytes: the whole page pool, so an upper bound); for a
step they are counted from the shapes (:func:`akv_jax.aot.step_compiles.step_traffic`),
because cost_analysis() counts the layer scan's body once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from akv_jax.aot.targets import TARGETS, Target, gpu_target_config

# Set before jax initialises its backends (scripts/aot.sh and bench/aot.py do).
ENV = {
    # No driver or cuDNN here: the CUDA plugin would refuse to load without this.
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
    # XLA runs ptxas with -v and logs its report at VLOG(2) of subprocess_compilation.
    "TF_CPP_MIN_LOG_LEVEL": "0",
    "TF_CPP_VMODULE": "subprocess_compilation=2",
    # libtpu takes a machine-wide lock file for the chip it drives; there is none here, so
    # two compiling processes (CI's, a developer's) must not exclude each other.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}

PAGE_SIZE = 16  # the server's default --page-size, in every compiled case


def check_env() -> list[str]:
    """The :data:`ENV` entries missing from this process's environment."""
    return [f"{k}={v}" for k, v in ENV.items() if os.environ.get(k) != v]


# ---------------------------------------------------------------------------------------
# Topologies


@functools.cache
def topology_devices(target_name: str, n: int = 4) -> tuple[Any, ...]:
    """``n`` abstract devices of the target (a four-chip TPU slice; a 1x1xn GPU host)."""
    from jax.experimental import topologies

    t = TARGETS[target_name]
    if t.platform == "tpu":
        topo = topologies.get_topology_desc(topology_name=t.topology, platform="tpu")
    else:
        topo = topologies.get_topology_desc(
            platform="cuda", topology_name="", target_config=gpu_target_config(t),
            topology=f"1x1x{n}",
        )
    devices = tuple(topo.devices)
    if len(devices) < n:
        raise ValueError(f"{target_name}: topology has {len(devices)} devices, need {n}")
    return devices[:n]


# ---------------------------------------------------------------------------------------
# Reading the compiler's reports


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Redirect file descriptor 2 (where XLA's C++ logging writes) into a list of one string.

    ptxas' report reaches us only as XLA log lines, so the compile runs with fd 2 pointed at
    a temporary file.
    """
    out: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out.append(f.read().decode(errors="replace"))


_PTXAS = re.compile(
    r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>sm_\w+)'.*?"
    r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, "
    r"(?P<ld>\d+) bytes spill loads.*?Used (?P<regs>\d+) registers",
    re.S,
)


def ptxas_reports(log: str) -> dict[str, dict[str, int]]:
    """``{kernel: {registers, spill_stores, spill_loads, stack}}`` from ptxas ``-v`` output."""
    out = {}
    for m in _PTXAS.finditer(log):
        out[m["name"]] = dict(
            registers=int(m["regs"]), spill_stores=int(m["st"]), spill_loads=int(m["ld"]),
            stack=int(m["stack"]),
        )
    return out


def tpu_kernel_vmem(hlo_text: str, kernel_names: tuple[str, ...]) -> dict[str, int]:
    """Scoped VMEM bytes each named Mosaic kernel uses, from the compiled HLO's custom calls
    (``used_scoped_memory_configs``, memory space 1 = VMEM)."""
    out: dict[str, int] = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?(\S+) = .*custom_call_target=\"tpu_custom_call\"", line)
        if not m:
            continue
        name = m[1].split(".")[0]
        if not any(name.startswith(k) for k in kernel_names):
            continue
        used = re.search(r'"used_scoped_memory_configs":\[([^\]]*)\]', line)
        vmem = r'"memory_space":"1","offset":"\d+","size":"(\d+)"'
        sizes = re.findall(vmem, used[1]) if used else []
        out[name] = max(out.get(name, 0), sum(int(s) for s in sizes))
    return out


def _cost(lowered: Any, compiled: Any) -> dict[str, float]:
    """flops and bytes accessed. XLA:TPU reports them for the compiled (partitioned, fused)
    program; the deviceless XLA:GPU compile reports none, so there the lowered (global,
    unfused) program's HLO cost analysis is used, on the CPU client."""
    ca = compiled.cost_analysis()
    if isinstance(ca, list):
        ca = ca[0] if ca else None
    if ca and "flops" in ca:
        return dict(flops=float(ca.get("flops", 0.0)), bytes=float(ca.get("bytes accessed", 0.0)),
                    cost_source="compiled")
    from jax._src.lib import _jax

    hlo = lowered.compiler_ir("hlo").as_hlo_module()
    ca = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, hlo)
    return dict(flops=float(ca.get("flops", 0.0)), bytes=float(ca.get("bytes accessed", 0.0)),
                cost_source="lowered")


@dataclasses.dataclass
class Result:
    kind: str  # "attention", "repos" or "step"
    target: str
    name: str  # e.g. "GPT-OSS-120B decode bf16 sinks+window"
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    devices: int = 1
    kernels: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # GPU: ptxas
    vmem: dict[str, int] = dataclasses.field(default_factory=dict)  # TPU: scoped VMEM bytes
    memory: dict[str, int] = dataclasses.field(default_factory=dict)  # memory_analysis()
    flops: float = 0.0
    bytes: float = 0.0
    cost_source: str = ""
    estimate_s: float = 0.0  # roofline estimate per device (see module docstring)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def spills(self) -> int:
        return sum(k["spill_stores"] + k["spill_loads"] for k in self.kernels.values())


def compile_one(
    result: Result, target: Target, fn: Callable[..., Any], args: tuple, device: Any
) -> Result:
    """Lower and compile ``fn(*args)`` for ``target``; fill ``result`` with what the compiler
    reports. A compile error is recorded (``ok=False``), not raised."""
    t0 = time.perf_counter()
    try:
        with captured_stderr() as log, jax.default_device(device):
            lowered = jax.jit(fn).lower(*args) if not hasattr(fn, "lower") else fn.lower(*args)
            compiled = lowered.compile()
        result.ok = True
    except Exception as e:  # the compiler's verdict is the result
        result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}"
        result.seconds = time.perf_counter() - t0
        return result
    result.seconds = time.perf_counter() - t0
    if target.platform == "cuda":
        reports = ptxas_reports(log[0])
        # akv_jax's Pallas kernels by name; XLA's own fusions summarised.
        result.kernels = {k: v for k, v in reports.items() if k.startswith("akv_")}
        xla = [v for k, v in reports.items() if not k.startswith("akv_")]
        result.extra["xla_kernels"] = dict(
            count=len(xla), max_registers=max((v["registers"] for v in xla), default=0),
            spill_bytes=sum(v["spill_stores"] + v["spill_loads"] for v in xla),
        )
    else:
        result.vmem = tpu_kernel_vmem(compiled.as_text(), ("akv_", "repos"))
    mem = compiled.memory_analysis()
    if mem is not None:
        result.memory = {
            k: int(getattr(mem, f"{k}_size_in_bytes"))
            for k in ("argument", "output", "alias", "temp", "generated_code")
        }
    result.__dict__.update(_cost(lowered, compiled))
    per_dev = result.devices if result.cost_source == "lowered" else 1
    result.estimate_s = roofline_s(result.flops, result.bytes, target, per_dev)
    return result


def roofline_s(flops: float, nbytes: float, target: Target, devices: int = 1) -> float:
    """The roofline estimate of a program's time: ``max(flops / peak, bytes / bandwidth)``
    per device, the work split evenly over ``devices``, at the data-sheet peaks."""
    return max(flops / devices / target.peak_bf16_flops,
               nbytes / devices / target.hbm_bytes_per_s)



def shape_struct(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype as an abstract argument placed by ``sharding``."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
