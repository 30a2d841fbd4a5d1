"""Deviceless compiles for real targets (akv_jax.aot): the toolchains' verdicts, checked.

Marked ``aot``: the main suite's environment has no libtpu / CUDA plugin / ptxas, so these
are deselected there (pyproject addopts) rather than skipped; CI runs them in their own
process in ``.venv-aot`` (scripts/aot.sh), where a missing toolchain fails them.
"""

from __future__ import annotations

import os

import pytest

from akv_jax.aot.compiler import ENV, shape_struct, topology_devices
from akv_jax.aot.kernel_compiles import KernelCase, compile_kernel, kernel_cases
from akv_jax.aot.step_compiles import StepCase, compile_step, kv_pool_tokens, step_cases
from akv_jax.aot.targets import TARGETS, gpu_target_config
from akv_jax.model.presets import preset_config

pytestmark = [
    pytest.mark.aot,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def _toolchain_env():
    # Set here too (the variables are read when the backends start, which is after import).
    for k, v in ENV.items():
        os.environ[k] = v


def test_target_table_covers_the_papers_gpu_and_tpus():
    assert {"A800", "H100", "H200", "TPU v5e", "TPU v6e"} <= set(TARGETS)
    a800 = TARGETS["A800"]
    assert (a800.arch, a800.cores) == ("sm_80", 108)
    assert TARGETS["H100"].arch == TARGETS["H200"].arch == "sm_90"
    assert "core_count: 108" in gpu_target_config(a800)


@pytest.mark.parametrize("target", list(TARGETS))
def test_ci_set_compiles_on_every_target(target):
    """The CI set (bench/aot.py --ci) for each target; a compile error fails CI. GPUs: no
    spills in the bf16 decode attention (ptxas' own report) on sm_80 and sm_90. TPUs: the
    kernels' scoped VMEM is read back."""
    for case in kernel_cases(full=False):
        r = compile_kernel(target, case)
        assert r.ok, f"{r.name} on {target}: {r.error}"
        if TARGETS[target].platform == "cuda":
            name = {"attention": "akv_segment_attention", "repos": "akv_repos",
                    "matmul": "akv_fixed_tile_matmul"}[case.kernel]
            k = r.kernels[name]
            assert 0 < k["registers"] <= 255
            assert k["spill_stores"] == k["spill_loads"] == 0, (target, case.name, k)
        else:
            assert r.vmem and all(0 < v < 16 << 20 for v in r.vmem.values()), r.vmem


def test_papers_setup_compiles_and_fits_on_a800():
    """GPT-OSS-120B, bf16, TP4 decode step on four A800s (auto backend: the Triton kernel),
    with room for a KV pool beside it."""
    (case,) = step_cases(full=False)
    r = compile_step("A800", case)
    assert r.ok, r.error
    assert r.kernels["akv_segment_attention"]["spill_stores"] == 0
    assert 60e9 < r.memory["argument"] < 62e9  # a quarter of the weights, plus the pool
    assert kv_pool_tokens(r, TARGETS["A800"].memory_bytes) > 500_000


def test_split_k_follows_the_target_sm_count():
    from akv_jax.pallas.segment_attention_gpu import default_kv_splits

    # 16 decode blocks x 8 kv heads = 128 programs: ~4 per SM needs 4 splits on an A800
    # (108 SMs) and 5 on an H100 (132).
    assert default_kv_splits(128, 64, num_cores=TARGETS["A800"].cores) == 4
    assert default_kv_splits(128, 64, num_cores=TARGETS["H100"].cores) == 5


def test_an_oversized_block_fails_the_tpu_compile():
    """A 2,048-row query block of Qwen3-8B's layout (8,192-row tile x 8 kv heads of float32
    accumulators) needs more VMEM than a v5e has: the compile fails, and so does CI."""
    r = compile_kernel(
        "TPU v5e", KernelCase("attention", "Qwen3-8B", "prefill", "f32"),
        block_q=2048, max_tile_rows=1 << 16,
    )
    assert not r.ok
    assert "vmem" in r.error.lower(), r.error


def test_auto_backend_compiles_the_mosaic_kernel_into_the_tpu_step():
    """``--attention-backend auto`` in the server's own step on a TPU: the Mosaic kernel (on a
    GPU the Triton one: the A800 test above; on the CPU the chunked jnp path:
    tests/test_pallas_attention.py)."""
    r = compile_step("TPU v5e", StepCase("SmolLM2-135M", 1, "decode", 1024))
    assert r.ok, r.error
    assert "akv_segment_attention" in r.vmem


@pytest.mark.parametrize("target", ["H100", "TPU v5e"])
def test_the_deterministic_step_compiles(target):
    """``--deterministic``'s step: every projection, the tied head's transposed read included
    where there is one, a fixed-tile Pallas matmul (SmolLM2: tied; on the GPU the attention
    without split-K), in the server's own step; no spills on the GPU."""
    r = compile_step(target, StepCase("SmolLM2-135M", 1, "decode", 1024, deterministic=True))
    assert r.ok, r.error
    if TARGETS[target].platform == "cuda":  # ptxas reports each variant (name__1, ...)
        mm = [k for k in r.kernels if k.startswith("akv_fixed_tile_matmul")]
        assert len(mm) >= 4 and "akv_segment_attention" in r.kernels, sorted(r.kernels)
        assert all(k["spill_stores"] == 0 for k in r.kernels.values()), r.kernels
    else:  # the scoped VMEM of each kernel name
        assert {"akv_fixed_tile_matmul", "akv_segment_attention"} <= set(r.vmem), r.vmem


def test_rerotated_copies_compile_tensor_parallel_on_tpu():
    """The server's re-rotated copies (``rerotate_copy_pool``: the repos kernel over gathered
    keys) at TP4 on a v5e: XLA:TPU cannot partition the Mosaic call, so it runs per head shard
    under the group's mesh (without the mesh it refuses: "cannot be automatically
    partitioned")."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from akv_jax.model.forward import KVPool
    from akv_jax.model.params import logical_to_spec, make_mesh
    from akv_jax.model.rope import rope_table_for
    from akv_jax.pallas.dispatch import make_repos_fn
    from akv_jax.serving.device_group import KV_AXES, rerotate_copy_pool

    cfg = preset_config("Qwen3-8B")
    devs = topology_devices("TPU v5e")
    mesh = make_mesh(4, list(devs))
    rep = NamedSharding(mesh, PartitionSpec())
    shape = (cfg.num_layers, 256, 16, cfg.num_kv_heads, cfg.head_dim)
    sh = NamedSharding(mesh, logical_to_spec(KV_AXES, shape, mesh))
    pool = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh)
    idx = jax.ShapeDtypeStruct((64,), jnp.int32, sharding=rep)
    rope = jax.tree.map(lambda x: shape_struct(x, rep), rope_table_for(cfg, 8192))
    repos = make_repos_fn("auto", platform="tpu")
    with jax.default_device(devs[0]):
        rerotate_copy_pool.lower(KVPool(pool, pool), idx, idx, idx, idx, rope, repos,
                             mesh=mesh).compile()
