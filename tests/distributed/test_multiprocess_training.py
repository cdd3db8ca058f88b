"""`python -m jaxrl.train` over 2 processes x 4 CPU devices trains exactly like 1 process x 8:
the same metrics step by step (GRPO on the quickstart model, with validation), and a
checkpoint written by 2 processes, restored by 2 after one of them was killed inside the next
save, continues identically."""

import json
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _env import xla_flags
from _multiproc import ROOT, clean_env, free_port

from jaxrl.compare import main as compare
from jaxrl.testing.numerics import STABLE_ADAM_OVERRIDES
from jaxrl.trainer.checkpoint import verify

pytestmark = pytest.mark.multiprocess

STEPS = 3
# Timings, throughput and the logged compile/gather times differ between runs by nature.
UNCOMPARABLE = ("timing_s/", "timing_per_token_ms/", "perf/", "fingerprint/")


def _overrides(run_dir, steps: int = STEPS, extra: tuple[str, ...] = ()) -> list[str]:
    cache = run_dir.parent.parent / "assets"
    return [
        "--config",
        "configs/quickstart.yaml",
        f"data.train_files={cache}/train.parquet",
        f"data.val_files={cache}/test.parquet",
        f"actor_rollout_ref.model.path={cache}/model",
        f"assets.dir={cache}",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=2",
        "trainer.save_freq=1",
        f"trainer.default_local_dir={run_dir}",
        *STABLE_ADAM_OVERRIDES,  # a step's rounding cannot move the next one by ~lr
        *extra,
    ]


def _train(run_dir, processes: int, steps: int = STEPS, extra: tuple[str, ...] = ()) -> str:
    """Run the trainer (`extra`: more overrides); returns the logs."""
    if processes == 1:
        env = clean_env(XLA_FLAGS=xla_flags(8))
        cmd = [sys.executable, "-m", "jaxrl.train", *_overrides(run_dir, steps, extra)]
    else:
        env = clean_env(
            JAXRL_LOG_DIR=str(run_dir.parent / f"logs-{run_dir.name}"),
            JAXRL_LAUNCH_CMD=f"{sys.executable} -m jaxrl.train",
            JAXRL_QUIET="1",
        )
        env["XLA_FLAGS"] = xla_flags(None)  # local.sh gives each process its 8 / N devices
        local_sh = str(ROOT / "launch" / "local.sh")
        cmd = ["bash", local_sh, str(processes), *_overrides(run_dir, steps, extra)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    logs = out.stdout + out.stderr
    if processes > 1:
        for log in sorted((run_dir.parent / f"logs-{run_dir.name}").glob("process_*.log")):
            logs += f"\n---- {log.name} ----\n" + log.read_text()
    assert out.returncode == 0, logs[-6000:]
    return logs


def _metrics(run_dir) -> dict[int, dict[str, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return {
        int(r["training/global_step"]): {
            k: v for k, v in r.items() if not k.startswith(UNCOMPARABLE)
        }
        for r in rows
    }


def _assert_same(got: dict[str, float], want: dict[str, float], where: str) -> None:
    """Every metric: the same rollouts, reduced over 4 devices of each process instead of
    8 of one (float32 sums in another order, ~1e-7 relative; 1e-6 absolute for means that
    are 0 up to rounding), 1e-5 relative the margin."""
    assert sorted(got) == sorted(want), where
    names = sorted(want)
    np.testing.assert_allclose(
        [got[k] for k in names],
        [want[k] for k in names],
        rtol=1e-5,
        atol=1e-6,
        err_msg=f"{where}: {names}",
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process x 8 devices, and 2 processes x 4 devices, each STEPS steps."""
    base = tmp_path_factory.mktemp("mp")
    single, multi = base / "runs" / "single", base / "runs" / "multi"
    _train(single, 1)  # writes the assets the other runs reuse
    multi_logs = _train(multi, 2)
    return single, multi, multi_logs


def test_two_processes_train_like_one(runs):
    single, multi, logs = runs
    assert "2 processes x 4 CPU devices" in logs
    want, got = _metrics(single), _metrics(multi)
    assert sorted(want) == list(range(STEPS + 1))  # step 0: validation before training
    assert sorted(got) == sorted(want)
    for step in want:
        _assert_same(got[step], want[step], f"step {step}")
    assert any(k.startswith("val-core/") for k in got[2])
    # The same rollouts and scores bit for bit (parameters differ in the last bits: the
    # collectives of 2 processes reduce in another order).
    assert compare([str(single), str(multi), "--only", "inputs"]) == 0


def test_dynamic_sampling_over_two_processes_equals_one(runs):
    """DAPO dynamic sampling (generation batches of 4 prompts for steps of 16) over 2
    processes: each generation batch is gathered from both and filtered on each, so the kept
    groups, the extra batches drawn from the loader and every metric equal one process's."""
    single, _, _ = runs
    extra = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
             "data.gen_batch_size=4", "trainer.val_before_train=false",
             "trainer.test_freq=-1")  # fmt: skip
    one, two = single.parent / "dapo_single", single.parent / "dapo_multi"
    _train(one, 1, steps=2, extra=extra)
    _train(two, 2, steps=2, extra=extra)
    want, got = _metrics(one), _metrics(two)
    assert sorted(want) == sorted(got) == [1, 2]
    for step in want:
        assert want[step]["train/num_gen_batches"] >= 2, want[step]  # it had to draw more
        _assert_same(got[step], want[step], f"dynamic sampling, step {step}")
    assert compare([str(one), str(two), "--only", "inputs"]) == 0


def test_a_killed_process_stops_the_run_and_a_restart_resumes_identically(runs):
    """The 2-process run from its step-2 checkpoint (step 3's removed, as if never written),
    SIGKILL one of its processes inside step 3's save: the other exits non-zero within 60 s
    naming it, steps 1-2 stay intact, and the same command resumes from step 2 on both
    processes; step 3 then equals the uninterrupted run's bit for bit (inputs and
    parameters)."""
    _, multi, _ = runs
    assert sorted(int(p.name) for p in (multi / "checkpoints").iterdir()) == [1, 2, 3]
    run_dir = multi.parent / "killed"
    shutil.copytree(multi, run_dir)
    checkpoints = run_dir / "checkpoints"
    shutil.rmtree(checkpoints / str(STEPS))
    port = free_port()
    logs = [run_dir.parent / f"killed_{i}.log" for i in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxrl.train", *_overrides(run_dir)],
            cwd=ROOT,
            env=clean_env(
                JAXRL_COORDINATOR=f"127.0.0.1:{port}",
                JAXRL_NUM_PROCESSES="2",
                JAXRL_PROCESS_ID=str(i),
                JAXRL_HEARTBEAT_TIMEOUT="10",  # the wait below: 10 s + the exit
            ),
            stdout=logs[i].open("w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 300
        while not any(checkpoints.glob("*.orbax-checkpoint-tmp*")):  # inside step 3's save
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            assert all(w.poll() is None for w in workers), logs[0].read_text()[-3000:]
            time.sleep(0.002)
        workers[1].send_signal(signal.SIGKILL)
        start = time.monotonic()
        rc = workers[0].wait(timeout=90)
        waited = time.monotonic() - start
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    text = logs[0].read_text()
    assert rc != 0, text[-3000:]
    assert waited < 60, text[-3000:]
    assert "[process 0/2] error: process 1" in text, text[-3000:]
    assert "resumed from step 2 of 3" in text
    saved = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert [s for s in saved if verify(checkpoints / str(s)) is None] == [1, 2]
    logs = _train(run_dir, 2)
    assert "[process 0/2] INFO jaxrl.train: resumed from step 2 of 3" in logs
    assert "[process 1/2] INFO jaxrl.train: resumed from step 2 of 3" in logs
    want, got = _metrics(multi), _metrics(run_dir)
    assert sorted(got) == sorted(want)
    _assert_same(got[STEPS], want[STEPS], f"resumed step {STEPS}")
    assert compare([str(multi), str(run_dir)]) == 0  # bit for bit: inputs and parameters
