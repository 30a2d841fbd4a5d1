"""The hardware akv_jax is compiled for: one row per target chip, with its vendor's figures.

Peak figures are the vendors' data-sheet numbers, used for roofline *estimates* only
(nothing here was measured on the chip):

* A800 / A100 80 GB SXM: NVIDIA A100 Tensor Core GPU data sheet
  (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
  nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 Tensor Core 312 TFLOPS (dense;
  624 with sparsity), HBM2e 2,039 GB/s, 80 GB, 108 SMs. The A800 80 GB SXM data sheet
  (nvidia.cn) gives the same compute and memory (only NVLink is cut to 400 GB/s); it is the
  paper's GPU.
* H100 SXM5 80 GB: NVIDIA H100 Tensor Core GPU data sheet
  (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet): BF16 1,979
  TFLOPS *with sparsity*, so 989.5 dense; HBM3 3.35 TB/s; 132 SMs.
* H200 SXM 141 GB: NVIDIA H200 product page / data sheet (nvidia.com/en-us/data-center/h200):
  BF16 1,979 TFLOPS with sparsity (989.5 dense), HBM3e 4.8 TB/s, 141 GB; the H100's SMs.
* TPU v5e: cloud.google.com/tpu/docs/v5e: 197 TFLOPS bf16, 819 GB/s, 16 GiB HBM per chip.
* TPU v6e (Trillium): cloud.google.com/tpu/docs/v6e: 918 TFLOPS bf16, 1,640 GB/s, 32 GiB.
* TPU v5p: cloud.google.com/tpu/docs/v5p: 459 TFLOPS bf16, 2,765 GB/s, 95 GiB (two
  TensorCores per chip, one JAX device: megacore).

GPU targets are described to XLA by a ``GpuTargetConfigProto`` (text form, built by
:func:`gpu_target_config`): XLA's GPU compiler then compiles without a device (Triton -> PTX
-> cubin through ptxas). SM-level limits (shared memory, registers) are the architecture's
(CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"; 8.0: 164 KB
shared memory per SM, 163 KB per block opt-in; 9.0: 228 KB and 227 KB). TPU targets are named
by a topology (``v5e:2x2``: four chips) that libtpu knows.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str  # "cuda" or "tpu"
    device_kind: str  # what jax reports for the chip
    peak_bf16_flops: float  # dense, per device
    hbm_bytes_per_s: float
    memory_bytes: int  # HBM per device
    cores: int  # SMs (GPU) or TensorCores per device (TPU)
    compute_capability: tuple[int, int] | None = None  # GPU
    shared_memory_per_sm: int = 0  # GPU, bytes
    shared_memory_per_block_optin: int = 0  # GPU, bytes
    l2_bytes: int = 0  # GPU
    clock_ghz: float = 0.0  # GPU boost clock
    topology: str | None = None  # TPU: a four-chip topology name libtpu knows

    @property
    def arch(self) -> str:
        """``sm_80`` / ``sm_90`` for a GPU, the device kind for a TPU."""
        if self.compute_capability is None:
            return self.device_kind
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"


GB = 10**9
GIB = 2**30

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("A800", "cuda", "NVIDIA A800-SXM4-80GB", 312e12, 2039e9, 80 * GB, 108,
               (8, 0), 164 * 1024, 163 * 1024, 40 * 2**20, 1.41),
        Target("H100", "cuda", "NVIDIA H100 80GB HBM3", 989.5e12, 3350e9, 80 * GB, 132,
               (9, 0), 228 * 1024, 227 * 1024, 50 * 2**20, 1.98),
        Target("H200", "cuda", "NVIDIA H200", 989.5e12, 4800e9, 141 * GB, 132,
               (9, 0), 228 * 1024, 227 * 1024, 50 * 2**20, 1.98),
        Target("TPU v5e", "tpu", "TPU v5 lite", 197e12, 819e9, 16 * GIB, 1, topology="v5e:2x2"),
        Target("TPU v6e", "tpu", "TPU v6 lite", 918e12, 1640e9, 32 * GIB, 1, topology="v6e:2x2"),
        Target("TPU v5p", "tpu", "TPU v5", 459e12, 2765e9, 95 * GIB, 2, topology="v5p:2x2x1"),
    )
}

# The paper's GPU (DESIGN §6: 4 prefill + 4 decode A800s at TP4): the memory plan is for it.
PAPER_TARGET = "A800"


def gpu_target_config(t: Target) -> str:
    """``GpuTargetConfigProto`` text for a deviceless XLA GPU compile of ``t``.

    Only what the compiler consults: compute capability (the PTX target), SM count (grid
    heuristics), shared memory and register limits (Triton and fusion checks), bandwidth,
    L2 and clock (the cost model), memory size.
    """
    if t.compute_capability is None:
        raise ValueError(f"{t.name} is not a GPU target")
    major, minor = t.compute_capability
    # sm_90a: Hopper's accelerated features (wgmma, TMA) that XLA's Triton path targets.
    ext = " feature_extension: ACCELERATED_FEATURES" if major == 9 else ""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {t.shared_memory_per_sm}
  shared_memory_per_block_optin: {t.shared_memory_per_block_optin}
  threads_per_core_limit: 2048
  core_count: {t.cores}
  fpus_per_core: {64 if major == 8 else 128}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(t.hbm_bytes_per_s)}
  l2_cache_size: {t.l2_bytes}
  clock_rate_ghz: {t.clock_ghz}
  device_memory_size: {t.memory_bytes}
  cuda_compute_capability {{ major: {major} minor: {minor}{ext} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{t.device_kind}"
"""
