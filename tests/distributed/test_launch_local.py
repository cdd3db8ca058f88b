"""`launch/local.sh N ...`: N processes on this machine, their logs, and failure propagation."""

import subprocess
import sys
import time

import pytest
from _env import xla_flags
from _multiproc import ROOT, WORKER, clean_env

pytestmark = pytest.mark.multiprocess

LOCAL_SH = ROOT / "launch" / "local.sh"


def _local_sh(tmp_path, n: int, command: str, *args: str) -> subprocess.CompletedProcess:
    env = clean_env(JAXRL_LAUNCH_CMD=command, JAXRL_LOG_DIR=str(tmp_path / "logs"))
    env["XLA_FLAGS"] = xla_flags(None)  # the session's flags; local.sh adds each one's devices
    return subprocess.run(
        ["bash", str(LOCAL_SH), str(n), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=85,
    )


def test_two_processes_end_to_end(tmp_path):
    out = _local_sh(tmp_path, 2, f"{sys.executable} {WORKER}", "collectives")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 processes x 4 CPU devices, coordinator 127.0.0.1:" in out.stderr
    assert "all 2 processes exited 0" in out.stderr
    for i in range(2):
        log = (tmp_path / "logs" / f"process_{i}.log").read_text()
        assert f'"process_id": {i}, "num_processes": 2' in log
        assert '"device_count": 8, "local_device_count": 4' in log
        assert '"psum": [28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0]' in log
    assert '"process_id": 0' in out.stdout  # process 0's log is echoed


def test_a_failing_process_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['JAXRL_PROCESS_ID'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(300)\n"
    )
    start = time.monotonic()
    out = _local_sh(tmp_path, 3, f"{sys.executable} {script}")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "process 1 exited with status 3; stopping the others" in out.stderr
    assert time.monotonic() - start < 30  # the sleepers were stopped, not waited for
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        f"process_{i}.log" for i in range(3)
    ]


def test_usage_without_a_process_count():
    out = subprocess.run(["bash", str(LOCAL_SH)], capture_output=True, text=True, timeout=10)
    assert out.returncode == 2
    assert "launch/local.sh N [train args ...]" in out.stderr
