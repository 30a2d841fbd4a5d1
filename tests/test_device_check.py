"""bench/device_check.py's pure logic: device names to peaks, the comparison, the byte count,
the parts' JSON when a part dies, and the summary line. The check itself runs once in CI, as
``bash scripts/device_check.sh --cpu`` (scripts/test.sh), not here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from bench_support import bench_module

dc = bench_module("device_check")


@pytest.mark.parametrize("kind, name, gbps", [
    ("NVIDIA H200", "H200", 4800),
    ("NVIDIA H200 NVL", "H200", 4800),
    ("NVIDIA H100 80GB HBM3", "H100", 3350),
    ("NVIDIA A800-SXM4-80GB", "A800", 2039),
    ("NVIDIA A100-SXM4-80GB", "A800", 2039),
])
def test_device_target_by_name(kind, name, gbps):
    t = dc.device_target(kind)
    assert t.name == name and t.hbm_bytes_per_s == gbps * 1e9


@pytest.mark.parametrize("kind", ["cpu", "TPU v5 lite", "NVIDIA L4"])
def test_device_target_unknown(kind):
    assert dc.device_target(kind) is None


def test_compare_counts_nan_and_tolerance():
    want = np.array([1.0, -2.0, 0.0])
    assert dc.compare(want + 1e-6, want, 1e-5)["ok"]
    bad = dc.compare(want + np.array([0, 1e-3, 0]), want, 1e-5)
    assert not bad["ok"] and bad["max_abs_err"] == pytest.approx(1e-3, rel=1e-4)
    nan = dc.compare(np.array([1.0, np.nan, 0.0]), want, 1.0)
    assert not nan["ok"] and nan["nan"] == 1


def test_decode_bytes():
    # 100 slots of K and V over 2 kv heads, q and output of 3 rows over 8 heads, head dim 4, bf16.
    assert dc.decode_bytes(100, 3, 8, 2, 4, 2) == (2 * 100 * 2 + 2 * 3 * 8) * 4 * 2


def test_time_per_call_syncs_once_per_round():
    calls, syncs = [], []
    secs = dc.time_per_call(lambda: calls.append(1) or len(calls), syncs.append, iters=4,
                            rounds=3)
    assert len(calls) == 1 + 3 * 4 and syncs == [1, 5, 9, 13] and secs >= 0


def _part(name, checks, complete=True, platform="gpu", device="NVIDIA H200"):
    meta = {"platform": platform, "device": device, "jax": "0.11.2"}
    return {"part": name, "meta": meta, "checks": checks, "complete": complete}


def test_load_parts_marks_an_unfinished_part(tmp_path):
    (tmp_path / "kernels.json").write_text(json.dumps(_part("kernels", [
        {"name": "attention x", "status": "pass"}])))
    (tmp_path / "engine.json").write_text(json.dumps(_part("engine", [
        {"name": "engine tiny", "status": "pass"}], complete=False)))
    parts = dc.load_parts(tmp_path, {"kernels": 0, "engine": 124, "step": -1})
    assert [p["part"] for p in parts] == ["kernels", "engine", "step"]  # bandwidth: not asked
    engine_end, step_end = parts[1]["checks"][-1], parts[2]["checks"][-1]
    assert engine_end["status"] == "fail" and "timed out" in engine_end["error"]
    assert step_end["status"] == "skip" and "not started" in step_end["reason"]


def test_summary_line_on_a_gpu():
    parts = [
        _part("kernels", [{"name": "attention a", "status": "pass"},
                          {"name": "attention b", "status": "fail", "error": "x"}]),
        _part("bandwidth", [
            {"name": "bandwidth Qwen3-8B kernel", "status": "pass", "hbm_fraction": 0.71,
             "peak_gbps": 4800.0},
            {"name": "bandwidth Qwen3-8B peer", "status": "pass", "hbm_fraction": 0.8},
            {"name": "bandwidth GPT-OSS-120B TP4 kernel", "status": "pass",
             "hbm_fraction": 0.5, "peak_gbps": 4800.0},
            {"name": "bandwidth GPT-OSS-120B TP4 peer", "status": "skip",
             "reason": "peer unavailable: no torch"},
        ]),
        _part("step", [{"name": "step GPT-OSS-20B decode", "status": "pass",
                        "tokens_per_s": 1500.0, "roofline_fraction": 0.75,
                        "roofline_tokens_per_s": 2000.0}]),
    ]
    line = dc.summary_line(parts, seconds=290)
    assert line.startswith("device_check: 5/6 checks pass on NVIDIA H200 (jax 0.11.2)")
    assert "1 skipped (peer unavailable: no torch)" in line
    assert "Qwen3-8B 71% (peer 80%), GPT-OSS-120B TP4 50% of 4800.0 GB/s" in line
    assert "GPT-OSS-20B decode step 1500 tok/s, 75% of its roofline (2000 tok/s)" in line
    assert line.endswith("290 s")


def test_summary_line_on_the_cpu():
    parts = [_part("step", [{"name": "step GPT-OSS-20B decode", "status": "pass",
                             "tokens_per_s": 3.0}], platform="cpu", device="cpu")]
    line = dc.summary_line(parts)
    assert line.startswith("device_check: 1/1 checks pass on cpu (jax 0.11.2, Pallas interpreted)")
    assert "1 timed checks ran (their timings mean nothing on cpu)" in line
