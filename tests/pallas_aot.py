"""Lower and export kernel-backed functions for a platform this host does not have (a
test-support module for tests/test_pallas_export.py).

``jax.export.export(jax.jit(f), platforms=["tpu"])`` needs nothing: Mosaic lowering is pure
Python and ``tpu_custom_call`` is on export's list of stable custom calls.

A few Mosaic lowering rules ask for the TPU generation, so :func:`lowering_target` names one
(an abstract TPU device) for TPU too.

For ``"cuda"`` two things are needed (jax 0.12):

* the Triton lowering asks which GPU it targets (compute capability) and, with no local GPU,
  fails with "No supported GPU devices found"; an abstract mesh whose
  ``AbstractDevice(device_kind="NVIDIA H100", platform="gpu")`` names the target answers it;
* the Triton custom call ``__gpu$xla.gpu.triton`` has no cross-version compatibility
  guarantee, so export refuses it unless that safety check is disabled. The artifact is then
  only good for the same jax/jaxlib version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"
_GPU = ("cuda", "rocm", "gpu")


DEFAULT_KIND = {"gpu": "NVIDIA H100", "tpu": "TPU v5 lite"}


@contextlib.contextmanager
def lowering_target(platform: str, device_kind: str | None = None) -> Iterator[None]:
    """Within this context kernels lower for ``device_kind`` even with no such device here."""
    family = "gpu" if platform in _GPU else platform
    here = jax.default_backend()
    if family not in DEFAULT_KIND or ("gpu" if here in _GPU else here) == family:
        yield
        return
    kind = device_kind or DEFAULT_KIND[family]
    device = AbstractDevice(device_kind=kind, num_cores=1 if family == "tpu" else None,
                            platform=family)
    mesh = AbstractMesh((1,), ("_target",), (AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(mesh):
        yield


def export(
    fn: Callable[..., Any], *args: Any, platform: str, device_kind: str | None = None
) -> jax.export.Exported:
    """``jax.export`` of ``jax.jit(fn)(*args)`` for ``platform`` ("cuda", "rocm" or "tpu").

    ``device_kind`` names the target chip ("NVIDIA H200", "TPU v6 lite", ...) when this host
    has none; a few lowering rules depend on the generation.
    """
    checks = []
    if platform in _GPU:
        checks.append(jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL_TARGET))
    with lowering_target(platform, device_kind):
        return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
