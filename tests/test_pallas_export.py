"""Both kernels lower and export for CUDA (Triton) and TPU (Mosaic) with no accelerator here.

This proves the kernel bodies pass Pallas' lowering for each target (Triton: power-of-two
tensor shapes, supported ops; Mosaic: block shapes, scalar prefetch, dynamic grid). It does
not run them: Triton->PTX and Mosaic's layout passes run when XLA compiles on the device.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pallas_aot as aot
import pallas_cases as cases
import pytest

from akv_jax.model.config import RopeConfig
from akv_jax.model.forward import KVPool, KVWrites, forward
from akv_jax.model.params import init_params
from akv_jax.model.presets import tiny_config
from akv_jax.model.rope import make_rope_table, rope_table_for
from akv_jax.pallas.dispatch import make_attention_fn
from akv_jax.pallas.repos import repos_pallas
from akv_jax.pallas.segment_attention_gpu import segment_attention_gpu
from akv_jax.pallas.segment_attention_tpu import segment_attention_tpu

# jax 0.12 warns on every Triton lowering; the GPU body is Triton by design (issue 4).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)
TARGET = {"cuda": aot.TRITON_CALL_TARGET, "tpu": "tpu_custom_call"}


def _custom_calls(exported) -> list[str]:
    return re.findall(r"custom_call @([\w$.]+)", exported.mlir_module())


def _abstract(case, *, num_kv_heads, group, head_dim, dtype):
    """Shapes only: the batch metadata is real (it decides static sizes), the data abstract."""
    batch = case.batch()
    q = jax.ShapeDtypeStruct((case.num_rows, num_kv_heads * group, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((case.num_pages, case.page_size, num_kv_heads, head_dim), dtype)
    return q, kv, kv, batch


ATTN = [  # (platform, target chip, kind, page_size, group, dtype, sinks + window)
    ("cuda", "NVIDIA H100", "decode", 16, 8, jnp.bfloat16, False),
    ("cuda", "NVIDIA H200", "restore", 64, 4, jnp.float32, True),
    ("tpu", "TPU v5 lite", "decode", 128, 8, jnp.bfloat16, False),
    ("tpu", "TPU v6 lite", "restore", 64, 4, jnp.float32, True),
]


@pytest.mark.parametrize("platform,chip,kind,ps,group,dtype,extras", ATTN)
def test_attention_exports(platform, chip, kind, ps, group, dtype, extras):
    rng = np.random.default_rng(0)
    if kind == "decode":
        case = cases.decode_case(rng, [300, 1000, 2048, 17], page_size=ps, drop_fraction=0.5)
    else:
        case = cases.restore_case(rng, (100, 300, 50, 200, 80), page_size=ps, block_q=64)
    args = _abstract(case, num_kv_heads=8, group=group, head_dim=128, dtype=dtype)
    body = segment_attention_gpu if platform == "cuda" else segment_attention_tpu
    kw = dict(sinks=jnp.zeros(8 * group), sliding_window=256) if extras else {}
    fn = functools.partial(body, block_q=case.block_q, sm_scale=128**-0.5, **kw)
    exported = aot.export(fn, *args, platform=platform, device_kind=chip)
    assert exported.platforms == (platform,)
    assert _custom_calls(exported).count(TARGET[platform]) == 1
    assert len(exported.mlir_module_serialized) > 1000  # the StableHLO artifact itself


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_repos_exports_in_place(platform):
    P, ps, Hkv, Dh = 64, 64, 8, 128
    k = jax.ShapeDtypeStruct((P, ps, Hkv, Dh), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((16,), jnp.int32)
    pos = jax.ShapeDtypeStruct((16, ps), jnp.int32)
    table = make_rope_table(RopeConfig(), Dh, 4096)
    body = "gpu" if platform == "cuda" else "tpu"
    exported = aot.export(functools.partial(repos_pallas, body=body), k, pages, pos, pos, table,
                          platform=platform)
    assert _custom_calls(exported).count(TARGET[platform]) == 1
    text = exported.mlir_module()
    # The key pool is aliased into the kernel's output: the update is in place.
    assert "output_operand_alias" in text


def test_tiny_model_forward_exports_for_cuda_with_kernel():
    """The model's forward, with the dispatcher's kernel for a GPU, lowers for CUDA."""
    cfg = tiny_config()
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    rope = rope_table_for(cfg, 1024)
    case = cases.prefill_case(np.random.default_rng(0), 40, 64, page_size=16, block_q=64)
    batch = case.batch()
    kv = jax.eval_shape(lambda: KVPool.zeros(cfg, case.num_pages, 16))
    T = case.num_rows
    writes = KVWrites(slots=jnp.zeros((1, T), jnp.int32), positions=jnp.zeros((1, T), jnp.int32))
    attention = make_attention_fn("auto", block_q=64, sm_scale=cfg.head_dim**-0.5,
                                  platform="gpu")

    def step(params, tokens, positions, kv, writes, batch, rope):
        return forward(params, cfg, tokens, positions, kv, writes, batch, rope, attention)

    tokens = jax.ShapeDtypeStruct((T,), jnp.int32)
    exported = aot.export(step, params, tokens, tokens, kv, writes, batch, rope, platform="cuda")
    # One kernel inside the scan over layers.
    assert _custom_calls(exported).count(aot.TRITON_CALL_TARGET) == 1
