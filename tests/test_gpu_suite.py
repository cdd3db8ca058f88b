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
        ["bash", "benchmarks/gpu_suite.sh", str(tmp_path / "out"), "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = (tmp_path / "out/results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert {r["step"] for r in records} == set(gpu_suite.STEPS)
    assert all(r["dry_run"] for r in records)
    by_step = {r["step"]: r for r in records}
    assert by_step["attention"]["lowered_for_cuda"]
    assert "tests collected" in by_step["tests"]["summary"]
    assert by_step["decode-1.5B"]["tokens_per_s"] > 0 and by_step["train-full"]["step_s"] > 0
    assert by_step["grpo-L"]["log_prob_s"] > 0  # two mini-batches: the old-log-prob pass ran
    assert "step " in (tmp_path / "out/summary.txt").read_text()


def test_peak_table_and_step_names(tmp_path):
    assert gpu_suite.bf16_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_suite.bf16_peak("NVIDIA H100 PCIe") == 756e12
    assert gpu_suite.bf16_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_suite.bf16_peak("cpu") is None
    with pytest.raises(SystemExit):
        gpu_suite.main([str(tmp_path), "--only", "nope"])
