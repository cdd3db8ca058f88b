"""`benchmarks/gpu_suite.sh --dry-run`: every step of the GPU measurement suite runs on the CPU
with tiny shapes (the Pallas kernels lowered for CUDA), so the suite works the day a GPU does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402


@pytest.mark.slow
def test_dry_run_runs_every_step(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "JAXRL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", str(tmp_path / "out"), "--no-install", "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = (tmp_path / "out/results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert {r["step"] for r in records} == set(gpu_suite.STEPS)
    assert all(r["dry_run"] for r in records)
    assert len({r["run"] for r in records}) == 1
    by_step = {r["step"]: r for r in records}  # the last record of each
    assert by_step["models"]["model"] == "S"
    assert [r["block_q"] for r in records if r["step"] == "attention"] == [64, 128]
    assert by_step["tests"]["returncode"] == 0
    assert by_step["decode-M"]["fraction_of_roofline"] > 0  # model S through its checkpoint
    assert by_step["decode-1.5B"]["tokens_per_s"] > 0 and by_step["train-full"]["step_s"] > 0
    assert by_step["decode-memory"]["peak_over_params_and_kv"] > 1  # XLA's own account
    assert by_step["grpo-L"]["log_prob_s"] > 0  # two mini-batches: the old-log-prob pass ran
    moe = [r["grouped_matmul"] for r in records if r["step"] == "train-moe"]
    assert moe == ["blocks", "ragged_dot"]
    assert "decode-L" in (tmp_path / "out/summary.txt").read_text()
    assert "jax:" in (tmp_path / "out/env.txt").read_text()


def test_peak_table_figures_and_arguments(tmp_path):
    assert gpu_suite.bf16_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_suite.bf16_peak("NVIDIA H100 PCIe") == 756e12
    assert gpu_suite.bf16_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_suite.bf16_peak("cpu") is None
    assert gpu_suite.mfu({"flops": 6e12, "step_s": 0.01}, 1e15) == {"mfu": 0.6}
    assert gpu_suite.mfu({"flops": 6e12, "step_s": 0.01}, None) == {}
    figures = {"fwd_tflops": 500.0, "fwd_bwd_tflops": 250.0}
    assert gpu_suite._of_peak(figures, 1000e12) == {"fwd_of_peak": 0.5, "fwd_bwd_of_peak": 0.25}
    (tmp_path / "results.jsonl").write_text('{"step": "env", "run": "a", "x": 1.0}\n{"step": "en')
    assert gpu_suite.read_records(tmp_path / "results.jsonl") == [
        {"step": "env", "run": "a", "x": 1.0}
    ]  # a line cut by a killed child is skipped
    for bad in (["--only", "nope"], ["--limit", "nope=3"], ["--limit", "env=x"]):
        with pytest.raises(SystemExit):
            gpu_suite.main([str(tmp_path), *bad])


def test_decode_profile_runs_on_the_cpu():
    """`benchmarks/decode_profile.py` times the decode step with the layer scans unrolled; a
    CPU trace has no device planes, so the kernel table stays out of its figures."""
    out = subprocess.run(
        [sys.executable, "decode_profile.py", "--size", "tiny", "--unroll"],
        cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.splitlines()[-1])
    assert figures["unroll"] and figures["decode_step_ms"] > 0
    assert "kernels_per_step" not in figures
