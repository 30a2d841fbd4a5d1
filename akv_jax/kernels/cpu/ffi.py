"""Builds and registers the XLA:CPU kernels written in C++ (``*.cc`` beside this module).

Each source is compiled on first use with the system's C++ compiler (``$CXX``, else ``g++``
or ``c++``; ``-O3 -march=native``) into ``$AKV_JAX_CACHE/kernels`` (default
``~/.cache/akv_jax/kernels``), keyed by a hash of the source, the flags, the compiler, the
CPU and jax's version, so each machine builds its own once. ``AKV_JAX_CPU_KERNEL=0``,
no compiler, or a failed build (a warning says why) leave a kernel unregistered, and its
callers keep their jnp path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax

HERE = Path(__file__).parent
# -ffp-contract=fast: products and sums fuse into FMA instructions (ISO C++ mode turns that
# off by default, which halves the speed of every inner loop here).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC")


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build(cxx: str, source: Path) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # pool.h, vec.h
    key = hashlib.sha256(
        "\0".join([source.read_text(), *headers, " ".join(FLAGS), version.stdout,
                   _cpu_identity(), jax.__version__]).encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("AKV_JAX_CACHE", Path.home() / ".cache" / "akv_jax"))
    lib = root / "kernels" / f"cpu_{source.stem}-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes (test workers) never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp],
                       capture_output=True, text=True, check=True)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _library(source: str) -> ctypes.CDLL | None:
    if os.environ.get("AKV_JAX_CPU_KERNEL", "1") == "0":
        return None
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        warnings.warn(f"no C++ compiler: the CPU kernels of {source} are off (jnp path)",
                      stacklevel=3)
        return None
    try:
        return ctypes.cdll.LoadLibrary(str(_build(cxx, HERE / source)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"{source} did not build ({detail.strip()[:500]}); using the jnp path",
                      stacklevel=3)
        return None


_registered: set[str] = set()  # XLA keeps a target's first handler for the process


def register(source: str, target: str, symbol: str) -> bool:
    """Build ``source`` (a file beside this module) and register its handler ``symbol`` as
    the XLA:CPU FFI target ``target``; False (with a warning) where that cannot be done or
    ``AKV_JAX_CPU_KERNEL=0``. Cheap after the first call (called at every trace)."""
    lib = _library(source)
    if lib is None:
        return False
    if target not in _registered:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
        _registered.add(target)
    return True


def int_constant(source: str, symbol: str) -> int | None:
    """``int symbol(void)`` of ``source``'s library (a layout constant its kernels fix, e.g.
    the GEMM's panel width); None where the library is off."""
    lib = _library(source)
    return None if lib is None else int(getattr(lib, symbol)())


def reset() -> None:
    """Decide again whether the kernels are on (tests switch ``AKV_JAX_CPU_KERNEL``)."""
    _library.cache_clear()
