"""Deviceless compiles for real targets (akv_jax.aot): the toolchains' verdicts, checked.

Marked ``aot``: the main suite's environment has no libtpu / CUDA plugin / ptxas, so these
are deselected there (pyproject addopts) rather than skipped; CI runs them in their own
process in ``.venv-aot`` (scripts/aot.sh), where a missing toolchain fails them.
"""

from __future__ import annotations

import os

import pytest

from akv_jax.aot import build
from akv_jax.aot.targets import TARGETS, gpu_target_config

pytestmark = [
    pytest.mark.aot,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def _toolchain_env():
    # Set here too (the variables are read when the backends start, which is after import).
    for k, v in build.ENV.items():
        os.environ[k] = v


def test_target_table_covers_the_papers_gpu_and_tpus():
    assert {"A800", "H100", "H200", "TPU v5e", "TPU v6e"} <= set(TARGETS)
    a800 = TARGETS["A800"]
    assert (a800.arch, a800.cores) == ("sm_80", 108)
    assert TARGETS["H100"].arch == TARGETS["H200"].arch == "sm_90"
    assert "core_count: 108" in gpu_target_config(a800)


def test_bf16_decode_kernels_do_not_spill_on_sm80_and_sm90():
    """ptxas' own report (registers, spill bytes) for the attention kernel at decode, bf16."""
    for target in ("A800", "H100"):
        for model in ("Qwen3-8B", "GPT-OSS-120B"):
            r = build.compile_kernel(target, build.KernelCase("attention", model, "decode", "bf16"))
            assert r.ok, r.error
            k = r.kernels["akv_segment_attention"]
            assert k["registers"] <= 255
            assert k["spill_stores"] == k["spill_loads"] == 0, (target, model, k)


def test_split_k_follows_the_target_sm_count():
    from akv_jax.pallas.segment_attention_gpu import default_kv_splits

    # 16 decode blocks x 8 kv heads = 128 programs: ~4 per SM needs 4 splits on an A800
    # (108 SMs) and 5 on an H100 (132).
    assert default_kv_splits(128, 64, num_cores=TARGETS["A800"].cores) == 4
    assert default_kv_splits(128, 64, num_cores=TARGETS["H100"].cores) == 5


def test_tpu_compile_reports_vmem():
    r = build.compile_kernel("TPU v5e", build.KernelCase("attention", "Qwen3-8B", "decode", "bf16"))
    assert r.ok, r.error
    assert 0 < r.vmem["akv_segment_attention"] < 16 << 20


def test_an_oversized_block_fails_the_tpu_compile():
    """A 2,048-row query block of Qwen3-8B's layout (8,192-row tile x 8 kv heads of float32
    accumulators) needs more VMEM than a v5e has: the compile fails, and so does CI."""
    r = build.compile_kernel(
        "TPU v5e", build.KernelCase("attention", "Qwen3-8B", "prefill", "f32"),
        block_q=2048, max_tile_rows=1 << 16,
    )
    assert not r.ok
    assert "vmem" in r.error.lower(), r.error


def test_auto_backend_compiles_the_pallas_kernels_into_the_step_on_gpu_and_tpu():
    """``--attention-backend auto`` in the server's own step: the Triton kernel on a GPU,
    the Mosaic kernel on a TPU (the chunked jnp path on the CPU is tests/test_pallas_*)."""
    case = build.StepCase("SmolLM2-135M", 1, "decode", 1024)
    gpu = build.compile_step("A800", case)
    assert gpu.ok, gpu.error
    assert "akv_segment_attention" in gpu.kernels
    tpu = build.compile_step("TPU v5e", case)
    assert tpu.ok, tpu.error
    assert "akv_segment_attention" in tpu.vmem
