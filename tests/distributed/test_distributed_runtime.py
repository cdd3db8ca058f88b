"""`jaxrl.distributed` across real processes: joining, gloo collectives, and failures.

2 processes x 4 fake CPU devices on 127.0.0.1, each `worker.py` in a subprocess.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from _multiproc import ROOT, WORKER, clean_env, free_port, output

pytestmark = pytest.mark.multiprocess


def _wait(proc, timeout: float) -> tuple[int, float]:
    """The worker's exit code and seconds waited; a worker still running after `timeout`
    fails the test with its log (what it was waiting for), not a bare TimeoutExpired."""
    start = time.monotonic()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"a worker still ran after {timeout} s; its log:\n{output(proc)}")
    return rc, time.monotonic() - start


def _result(proc) -> dict:
    # Gloo's C++ threads print to the same stdout in pieces, so the worker's line (one write)
    # may land inside one of theirs: "[Gloo] Rank 1RESULT {...}".
    lines = [ln.partition("RESULT ")[2] for ln in output(proc).splitlines() if "RESULT " in ln]
    assert lines, output(proc)
    return json.loads(lines[-1])


def test_two_processes_share_eight_devices_and_reduce_over_gloo(procs):
    port = free_port()
    workers = [procs.start("collectives", i, 2, port) for i in range(2)]
    for proc in workers:
        rc, _ = _wait(proc, 80)
        assert rc == 0, output(proc)
    for i, proc in enumerate(workers):
        row = _result(proc)
        assert row["process_id"] == row["process_index"] == i
        assert row["num_processes"] == 2
        assert (row["device_count"], row["local_device_count"]) == (8, 4)
        assert row["psum"] == [28.0] * 8  # psum over x = 0..7, half of it from each process
        assert row["total"] == 28.0
        assert row["allgather"] == [[1], [11]]
        assert row["main"] == (i == 0)
        assert row["prefix"] == f"[process {i}/2] "


def test_a_peer_that_never_starts_is_named_with_the_coordinator(procs):
    """Process 0 alone waits for 1; process 1 alone (another run) finds no coordinator."""
    port0, port1 = free_port(), free_port()
    alone0 = procs.start("init", 0, 2, port0, JAXRL_INIT_TIMEOUT="8")
    alone1 = procs.start("init", 1, 2, port1, JAXRL_INIT_TIMEOUT="8")
    for proc, port, missing in ((alone0, port0, "[1]"), (alone1, port1, "[0]")):
        rc, waited = _wait(proc, 80)
        text = output(proc)
        assert rc == 1, text
        assert waited < 8 + 30, text  # 8 s plus interpreter start on a loaded machine
        pid = 0 if proc is alone0 else 1
        assert f"process {pid} of 2 waited 8 s at coordinator 127.0.0.1:{port}" in text
        assert f"processes that did not join: {missing}" in text
        assert "Terminating process" not in text  # jaxrl's message, not JAX's abort


@pytest.mark.parametrize("victim", [1, 0], ids=["kill-process-1", "kill-coordinator"])
def test_killing_one_process_stops_the_other_with_an_error(procs, victim):
    port = free_port()
    workers = [procs.start("loop", i, 2, port, JAXRL_HEARTBEAT_TIMEOUT="10") for i in range(2)]
    deadline = time.monotonic() + 60
    while not all("READY" in output(p) for p in workers):  # both in the loop of collectives
        assert time.monotonic() < deadline, [output(p) for p in workers]
        assert all(p.poll() is None for p in workers), [output(p) for p in workers]
        time.sleep(0.2)
    workers[victim].send_signal(signal.SIGKILL)
    survivor = workers[1 - victim]
    rc, waited = _wait(survivor, 60)
    text = output(survivor)
    assert rc != 0, text
    assert waited < 60, text
    if victim == 1:  # jaxrl's monitor names it
        assert "[process 0/2] error: process 1 stopped sending heartbeats" in text
    else:
        # Process 0 hosts the coordination service: JAX's client aborts the survivor the
        # moment it goes (SIGABRT), usually before jaxrl's monitor polls, naming the leader.
        assert (
            "process 0, which hosts it, died" in text
            or "the leader task was preempted/died" in text
        ), text


def test_an_uncaught_exception_in_one_process_stops_the_other_naming_it(procs):
    port = free_port()
    workers = [procs.start("raise", i, 2, port, JAXRL_HEARTBEAT_TIMEOUT="10") for i in range(2)]
    rc, _ = _wait(workers[0], 80)
    text = output(workers[0])
    assert rc == 1, text
    assert "[process 0/2] error: process 1 failed: RuntimeError: boom on purpose" in text
    assert workers[1].wait(timeout=30) != 0
    assert "RuntimeError: boom on purpose" in output(workers[1])  # its own traceback


def test_slurm_tasks_are_detected_without_jaxrl_variables(tmp_path):
    """No JAXRL_*: JAX's SLURM detection (srun's variables) gives ids, count and coordinator."""
    slurm = dict(
        SLURM_JOB_ID="77",
        SLURM_STEP_NODELIST="localhost",
        SLURM_NTASKS="2",
        JAX_COORDINATOR_PORT=str(free_port()),
    )
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "collectives"],
            cwd=ROOT,
            env=clean_env(SLURM_PROCID=str(i), SLURM_LOCALID=str(i), **slurm),
            stdout=(tmp_path / f"{i}.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        for i, proc in enumerate(workers):
            text = (tmp_path / f"{i}.log").read_text
            assert proc.wait(timeout=80) == 0, text()
            assert f"[process {i}/2] joining 2 processes at coordinator localhost:" in text()
            assert "slurm auto-detection" in text()
            assert '"device_count": 8' in text()
    finally:
        for proc in workers:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def test_host_data_across_processes_and_generation_per_process(procs):
    """`jaxrl.sharding.processes` over 2 processes, and `generate` with each process's own
    prompts: one program over the 8 devices, each process gets its own rows back, equal to
    a single-process generation of the same prompts; each process's share of the engine
    (`RolloutEngine.local`) runs its rows on its own slots alike; and an engine on process
    1's devices only generates both processes' rows alike."""
    import jax
    import numpy as np

    import jaxrl.models as M
    from jaxrl.rollout import SamplingParams, generate
    from jaxrl.testing.tiny import tiny_decoder

    port = free_port()
    workers = [procs.start("processes", i, 2, port) for i in range(2)]
    for proc in workers:
        rc, _ = _wait(proc, 120)
        assert rc == 0, output(proc)
    results = [_result(proc) for proc in workers]
    config = tiny_decoder()
    params = M.init_params(config, jax.random.key(0), std=0.5)
    greedy = SamplingParams(max_tokens=4, n=2, do_sample=False, temperature=0.0)
    for i, row in enumerate(results):
        assert row["rows_x"] == [[0, 0], [1, 1], [1, 1]]
        assert row["rows_y"] == [0.0, 0.0, 1.0] and row["rows_y_dtype"] == "float64"
        assert row["rows_z"] == [2**40, 2**40 + 1, 2**40 + 1]
        assert row["host_values"] == [3.0, [3]]
        assert "the processes pass different arrays: [['a'], ['b']]" in row["keys_error"]
        assert row["objects"] == [{"pid": 0, "words": []}, {"pid": 1, "words": ["a"]}]
        assert row["doubled_ok"]
        assert row["process_rows"] == [4 * i, 4 * i + 4]
        assert "`x` has different trailing shapes" in row["shape_error"]
        assert "every process must pass the same number of prompts" in row["count_error"]
        assert "process 0: 1, process 1: 2" in row["count_error"]
        ids = np.asarray(row["prompts"])
        alone = generate(config, params, ids, np.ones_like(ids), greedy)
        np.testing.assert_array_equal(row["responses"], np.asarray(alone.responses))
        few = ids[:3]
        alone = generate(config, params, few, np.ones_like(few), greedy)
        np.testing.assert_array_equal(row["padded_responses"], np.asarray(alone.responses))
        # each process's share of the engine: its own 4 devices (dp 2 x tp 2), half the
        # slots, its rows on its own slots as one process generates them
        assert row["local_devices"] == [i] * 4 and row["local_shape"] == {"dp": 2, "tp": 2}
        assert row["local_slots"] == 4 and row["local_version"] == [1, 2]
        alone = generate(config, params, ids, np.ones_like(ids), greedy)
        np.testing.assert_array_equal(row["local_responses"], np.asarray(alone.responses))
        # an engine on process 1's devices only: both generate on it, each its own rows
        np.testing.assert_array_equal(row["placed_responses"], np.asarray(alone.responses))
        np.testing.assert_array_equal(row["local_again"], np.asarray(alone.responses))
        assert row["local_released"] and row["span"] == [i, 3]
        errors = row["local_errors"]
        assert "Scheduler(engine.local())" in errors["spanning"]
        assert "has devices of processes [0, 1]" in errors["tp"]
        assert "split along `dp`" in errors["split"]
        # a role's arrays between the processes' device groups, device to device: the
        # shards each process holds of the target, each the right block
        held = {"alike": 4 * i, "whole": 4 * i, "4 to 2": 2 * i,
                "back 2 to 4, whole": 4 * (1 - i), "onto both": 4}  # fmt: skip
        assert row["moves"] == {k: [n, True, True] for k, n in held.items()}, row["moves"]
        assert row["holds_own"] and not row["holds_other"] and row["read_own"]
        # arrays of process 0's devices only: read by both and checkpointed
        placed = row["one_process"]
        assert placed["read"] and placed["restored"] and placed["verified"], placed
        assert "the processes pass different arrays" in placed["local_error"]
        assert "[([0], [(2,)])], [([2048], [(2,)])]" in placed["local_error"]
    # process 1 got them device to device, a packed buffer per device group (8 x 6 float32,
    # 3 bools, 2 int32; a bfloat16, the empty array not sent), beyond the description of the
    # arrays both processes exchange
    received = [row["one_process"]["received"] for row in results]
    assert received[1] - received[0] == (8 * 6 * 4 + 3 + 2 * 4) + 2
