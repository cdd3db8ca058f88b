"""`python -m jaxrl.train` over 2 processes x 4 CPU devices trains exactly like 1 process x 8:
the same metrics step by step (GRPO on the quickstart model, with validation; DAPO's dynamic
sampling; the tool demo's agent loop, each process running its rows on its own devices), and
a checkpoint written by 2 processes, restored by 2 after one of them was killed inside the
next save, continues identically."""

import collections
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest
from _env import xla_flags
from _multiproc import ROOT, clean_env, free_port

from jaxrl.assets import write_quickstart_model
from jaxrl.checkpoint import Checkpoints, verify
from jaxrl.compare import main as compare
from jaxrl.testing.numerics import STABLE_ADAM_OVERRIDES

pytestmark = pytest.mark.multiprocess

STEPS = 3
PYTHONPATH = f"{ROOT}:{ROOT / 'tests' / 'distributed'}"  # marked_tools, the tool of the fault
# Timings, throughput and the logged compile/gather times differ between runs by nature.
UNCOMPARABLE = ("timing_s/", "timing_per_token_ms/", "perf/", "fingerprint/")
# Streamed dynamic sampling's effort past its cut: which groups had started when the cut was
# known depends on the slots of each process (jaxrl.rollout.streaming), and so do the reward
# manager's counts over every judged group; the kept set does not.
EFFORT = (
    *(f"training/filter_groups/{k}" for k in
      ("discarded_surplus_samples", "aborted_groups", "sampled_tokens_per_group")),
    "reward/errors",
    "reward/timeouts",
)  # fmt: skip


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


def _train(
    run_dir,
    processes: int,
    steps: int = STEPS,
    extra: tuple[str, ...] = (),
    args: list[str] | None = None,
) -> str:
    """Run the trainer (`extra`: more overrides; `args`: the whole command line instead of
    the quickstart's); returns the logs."""
    args = _overrides(run_dir, steps, extra) if args is None else args
    if processes == 1:
        env = clean_env(XLA_FLAGS=xla_flags(8), PYTHONPATH=PYTHONPATH)
        cmd = [sys.executable, "-m", "jaxrl.train", *args]
    else:
        env = clean_env(
            JAXRL_LOG_DIR=str(run_dir.parent / f"logs-{run_dir.name}"),
            JAXRL_LAUNCH_CMD=f"{sys.executable} -m jaxrl.train",
            JAXRL_QUIET="1",
            PYTHONPATH=PYTHONPATH,
        )
        env["XLA_FLAGS"] = xla_flags(None)  # local.sh gives each process its 8 / N devices
        local_sh = str(ROOT / "launch" / "local.sh")
        cmd = ["bash", local_sh, str(processes), *args]
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


def _assert_two_steps_alike(one, two, where: str) -> None:
    """Runs `one` (1 process) and `two` (2) of 2 steps with validation at step 2: every
    metric alike (`_assert_same`), and the inputs bit for bit."""
    want, got = _metrics(one), _metrics(two)
    assert sorted(want) == sorted(got) == [1, 2]
    for step in want:
        _assert_same(got[step], want[step], f"{where}, step {step}")
    assert any(k.startswith("val-core/") for k in got[2])
    assert compare([str(one), str(two), "--only", "inputs"]) == 0


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
    assert "the step's batch: each process holds its own 128 of 256 rows" in logs
    want, got = _metrics(single), _metrics(multi)
    assert sorted(want) == list(range(STEPS + 1))  # step 0: validation before training
    assert sorted(got) == sorted(want)
    for step in want:
        _assert_same(got[step], want[step], f"step {step}")
    assert any(k.startswith("val-core/") for k in got[2])
    # The same rollouts and scores bit for bit (parameters differ in the last bits: the
    # collectives of 2 processes reduce in another order).
    assert compare([str(single), str(multi), "--only", "inputs"]) == 0


@pytest.mark.parametrize("streaming", [False, True], ids=["batches", "streaming"])
def test_dynamic_sampling_over_two_processes_equals_one(runs, streaming):
    """DAPO dynamic sampling (generation batches of 4 prompts for steps of 16) over 2
    processes equals one process's: the kept groups, the extra batches drawn from the loader
    and every metric; each process keeps its own kept rows, and the devices put them in the
    batch's order. Batches: each process filters its slice of every generation batch, the
    counts summed over both. Streaming (groups of 4 through 16 slots, 8 per process; `acc`
    drops most groups): each process streams its own slice of every batch, and the kept set
    is the first 16 kept in prompt order, whichever process judged them first."""
    single, _, _ = runs
    extra = ["algorithm.filter_groups.enable=true", "data.gen_batch_size=4",
             "trainer.val_before_train=false", "trainer.test_freq=-1",
             f"algorithm.filter_groups.streaming={streaming}"]  # fmt: skip
    if streaming:
        extra += ["algorithm.filter_groups.metric=acc", "actor_rollout_ref.rollout.n=4",
                  "actor_rollout_ref.rollout.max_num_seqs=16",
                  "algorithm.filter_groups.max_num_gen_batches=0"]  # fmt: skip
    else:
        extra += ["algorithm.filter_groups.metric=seq_reward"]
    name = "stream" if streaming else "dapo"
    one, two = single.parent / f"{name}_single", single.parent / f"{name}_multi"
    _train(one, 1, steps=2, extra=tuple(extra))
    logs = _train(two, 2, steps=2, extra=tuple(extra))
    assert "the step's batch: each process places its own kept rows" in logs
    want, got = _metrics(one), _metrics(two)
    assert sorted(want) == sorted(got) == [1, 2]
    for step in want:
        assert want[step]["train/num_gen_batches"] >= 2, want[step]  # it had to draw more
        if streaming:
            assert want[step]["training/filter_groups/evicted_samples"] > 0, want[step]
            for effort in EFFORT:  # how many groups ran past the cut: each process's slots
                got[step].pop(effort, None), want[step].pop(effort, None)
        _assert_same(got[step], want[step], f"dynamic sampling, step {step}")
    assert compare([str(one), str(two), "--only", "inputs"]) == 0


def test_placed_roles_over_two_processes_equal_one(runs):
    """PPO with the rollout, the reference and the critic on device groups of their own
    (2 devices each, the trainer the other 2): on 2 processes each group takes one device of
    each (`role_layouts`), so the weight push, the passes' inputs and their results cross
    between the processes' device groups device to device (`reshard.moved`); every metric
    equals one process's with the same groups on its 8 devices, and the inputs bit for bit.
    (Placed against colocated in one process: tests/trainer/test_placement.py.)"""
    single, _, _ = runs
    extra = ("critic.enable=true", "actor_rollout_ref.actor.use_kl_loss=true",
             *(f"mesh.placement.{role}.devices=2" for role in ("rollout", "ref", "critic")),
             "trainer.val_before_train=false")  # fmt: skip
    one, two = single.parent / "placed_single", single.parent / "placed_multi"
    _train(one, 1, steps=2, extra=extra)
    logs = _train(two, 2, steps=2, extra=extra)
    assert "critic mesh:  {'dp': 1, 'fsdp': 2, 'ep': 1, 'tp': 1, 'sp': 1} on devices 3-2051" in logs
    _assert_two_steps_alike(one, two, "placed roles")


def test_roles_on_some_processes_devices_equal_one_process(runs):
    """`mesh.placement.spread=false`: the trainer on process 0's 4 devices only, the rollout
    and the reference each on 2 of process 1's (issue 41's example). Process 0's prompts
    reach the rollout and every row comes back device to device, the weight push and the
    reference's pass cross the processes, the step's batch is gathered (process 1 holds no
    trainer device), process 1 reads the trainer's metrics device to device, and the
    checkpoints are written through copies on process 1 (orbax refuses an array of one
    process): every metric equals one process's with the same groups on its 8 devices, and
    the inputs bit for bit."""
    single, _, _ = runs
    extra = ("mesh.placement.spread=false", "mesh.placement.rollout.devices=2",
             "mesh.placement.ref.devices=2", "actor_rollout_ref.actor.use_kl_loss=true",
             "data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=12",
             "trainer.val_before_train=false")  # fmt: skip
    one, two = single.parent / "unspread_single", single.parent / "unspread_multi"
    _train(one, 1, steps=2, extra=extra)
    logs = _train(two, 2, steps=2, extra=extra)
    assert "train mesh:   {'dp': 1, 'fsdp': 4, 'ep': 1, 'tp': 1, 'sp': 1} on devices 0-3" in logs
    assert "rollout mesh: {'dp': 2, 'tp': 1} on devices 2048-2049" in logs
    ref = "ref mesh:     {'dp': 1, 'fsdp': 2, 'ep': 1, 'tp': 1, 'sp': 1} on devices 2050-2051"
    assert ref in logs
    assert [verify(two / "checkpoints" / str(s)) for s in (1, 2)] == [None, None]
    _assert_two_steps_alike(one, two, "roles on one process")


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
    text, waited = _kill_inside(  # inside step 3's save
        run_dir, _overrides(run_dir), lambda: any(checkpoints.glob("*.orbax-checkpoint-tmp*"))
    )
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


def _trained_rows(meta: dict, per_step: int) -> collections.Counter:
    """The dataset rows a fully_async checkpoint says were trained: the loader's rows drawn
    (its position's batches, in its epoch-0 order: `PromptIterator.order`) less the feed's
    pending ones (asserted among them)."""
    data = meta["data"]
    assert data["epoch"] == 0
    order = np.random.default_rng([data["seed"], 0]).permutation(data["num_rows"])
    drawn = collections.Counter(order[: meta["data"]["position"] * per_step].tolist())
    pending = collections.Counter(meta["async_feed"]["pending"])
    assert not pending - drawn, "a pending prompt the loader never gave"
    return drawn - pending


def test_fully_async_over_two_processes_trains_each_prompt_once_across_a_resume(runs):
    """`async_training.mode=fully_async` with the rollouter on process 1's 4 devices and the
    trainer on process 0's (its groups posted to process 0 through the coordination
    service, the weights pushed across the processes every step, validation between): 4
    steps saving at 2 and 4, then step 4's checkpoint removed and the same command resumed
    from step 2. Each checkpoint written by process 0 carries the rollout process's feed:
    the rows trained so far (the loader's drawn rows less the pending ones) are each
    once, R per step, those of step 2 among those of step 4 after the resume; no trained
    token is past the staleness bound and some lag."""
    single, _, _ = runs
    run_dir = single.parent / "fully_async"
    per_step, steps = 8, 4
    extra = ("mesh.placement.spread=false", "mesh.placement.rollout.devices=4",
             f"data.train_batch_size={per_step}",
             f"actor_rollout_ref.actor.ppo_mini_batch_size={per_step}",
             "async_training.mode=fully_async", "async_training.trigger_parameter_sync_step=1",
             "async_training.staleness_threshold=2.0",  # 3 steps of groups a version: pending
             "algorithm.rollout_correction.rollout_is=token",
             "trainer.save_freq=2", "trainer.val_before_train=false")  # fmt: skip
    args = _overrides(run_dir, steps, extra)
    logs = _train(run_dir, 2, steps, args=args)
    assert "rollout mesh: {'dp': 4, 'tp': 1} on devices 2048-2051" in logs
    metrics = _metrics(run_dir)
    assert sorted(metrics) == list(range(1, steps + 1))
    bound = 3  # versions: the gate's ceil(1 + 2.0) pushes x 1 update a push
    assert all(metrics[s]["async/staleness/max"] <= bound for s in metrics)
    assert any(metrics[s]["async/staleness/max"] > 0 for s in metrics)
    assert any(k.startswith("val-core/") for k in metrics[2])

    checkpoints = run_dir / "checkpoints"
    ckpts = Checkpoints(checkpoints)
    first = {s: _trained_rows(ckpts.read_meta(s), per_step) for s in (2, 4)}
    ckpts.close()
    shutil.rmtree(checkpoints / str(steps))
    logs = _train(run_dir, 2, steps, args=args)
    assert "[process 1/2] INFO jaxrl.train: resumed from step 2 of 4" in logs
    ckpts = Checkpoints(checkpoints)
    resumed = _trained_rows(ckpts.read_meta(steps), per_step)
    ckpts.close()
    for trained, count in ((first[2], 2), (first[4], 4), (resumed, 4)):
        assert set(trained.values()) == {1} and trained.total() == count * per_step
    assert not first[2] - resumed  # the rows trained before the checkpoint, kept


def test_agent_loop_over_two_processes_equals_one(tmp_path_factory):
    """The tool demo (multi-turn GRPO with the calculator; 16 trajectories a step through 8
    slots, 4 per process) over 2 processes, each running the agent loop over its own rows
    on its own 4 devices with its own tool runner: the same inputs (rollouts and scores bit
    for bit), every metric (the agent's, gathered over both, included) and validation as one
    process's, and the rollout dump (written by process 0, the conversations of both) the
    same file; likewise with the rollout on process 1's devices only (process 0's
    conversations routed there). Then a peer killed inside a tool call of step 2: the other
    stops within the heartbeat timeout naming it, and the same command resumes from step 1
    to the uninterrupted run's step 2 bit for bit."""
    base = tmp_path_factory.mktemp("mp_tools")
    cache = base / "assets"
    tools = base / "tools.yaml"  # the demo's calculator, able to say it is running
    tools.write_text(
        (ROOT / "configs" / "tools" / "calculator.yaml")
        .read_text()
        .replace("jaxrl.agent.tools.calculator.Calculator", "marked_tools.MarkedCalculator")
    )

    def args(run_dir) -> list[str]:
        return [
            "--config", "configs/quickstart_tools.yaml",
            f"assets.dir={cache}", "assets.train_size=64", "assets.val_size=8",
            f"data.train_files={cache}/train.parquet", f"data.val_files={cache}/test.parquet",
            f"actor_rollout_ref.model.path={cache}/model",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.max_num_seqs=8",
            "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=1",
            "trainer.val_before_train=false", "trainer.logger=[console]",
            f"trainer.default_local_dir={run_dir}", f"trainer.rollout_data_dir={run_dir}/dump",
            *STABLE_ADAM_OVERRIDES,
        ]  # fmt: skip

    write_quickstart_model(cache / "model", tools=True, prior_steps=60)  # a short prior
    single, multi = base / "runs" / "single", base / "runs" / "multi"
    _train(single, 1, args=args(single))  # writes the data the other run reuses
    logs = _train(multi, 2, args=args(multi))
    assert "2 processes x 4 CPU devices" in logs
    want, got = _metrics(single), _metrics(multi)
    assert sorted(want) == sorted(got) == [1, 2]
    for step in want:
        assert want[step]["agent/tool_calls/total"] > 0, want[step]  # the tool was used
        _assert_same(got[step], want[step], f"agent loop, step {step}")
    assert any(k.startswith("val-core/") for k in got[2])
    assert compare([str(single), str(multi), "--only", "inputs"]) == 0
    for step in (1, 2):
        assert (multi / "dump" / f"{step}.jsonl").read_text() == (
            single / "dump" / f"{step}.jsonl"
        ).read_text()

    # the rollout on process 1's 4 devices only, the trainer on process 0's: process 1 runs
    # both processes' conversations with its tools, process 0's rows sampling as theirs
    placed = ("mesh.placement.spread=false", "mesh.placement.rollout.devices=4",
              "trainer.test_freq=-1", "trainer.save_freq=-1")  # fmt: skip
    one, two = base / "runs" / "placed_single", base / "runs" / "placed_multi"
    _train(one, 1, args=[*args(one), *placed])
    logs = _train(two, 2, args=[*args(two), *placed])
    assert "rollout mesh: {'dp': 4, 'tp': 1} on devices 2048-2051" in logs
    want, got = _metrics(one), _metrics(two)
    for step in (1, 2):
        assert want[step]["agent/tool_calls/total"] > 0, want[step]
        _assert_same(got[step], want[step], f"placed agent loop, step {step}")
        assert (two / "dump" / f"{step}.jsonl").read_text() == (
            one / "dump" / f"{step}.jsonl"
        ).read_text()
    assert compare([str(one), str(two), "--only", "inputs"]) == 0

    killed = base / "runs" / "killed"
    shutil.copytree(multi, killed)
    shutil.rmtree(killed / "checkpoints" / "2")
    marks = base / "marks"
    marks.mkdir()
    text, waited = _kill_inside(killed, args(killed), (marks / "process_1").exists,
                                JAXRL_TEST_TOOL_MARK=str(marks))  # fmt: skip
    assert waited < 60, text[-3000:]
    assert "[process 0/2] error: process 1" in text, text[-3000:]
    assert "resumed from step 1 of 2" in text
    logs = _train(killed, 2, args=args(killed))
    assert "[process 1/2] INFO jaxrl.train: resumed from step 1 of 2" in logs
    assert compare([str(multi), str(killed)]) == 0  # bit for bit: inputs and parameters


def _kill_inside(run_dir, args, ready: Callable[[], bool], **env) -> tuple[str, float]:
    """Start the run's 2 processes (`env` added), SIGKILL process 1 once `ready()`, and wait
    for process 0 to exit: (its log, seconds it took). Asserts it exited non-zero."""
    victim = 1
    port = free_port()
    logs = [run_dir.parent / f"{run_dir.name}_{i}.log" for i in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxrl.train", *args],
            cwd=ROOT,
            env=clean_env(
                JAXRL_COORDINATOR=f"127.0.0.1:{port}",
                JAXRL_NUM_PROCESSES="2",
                JAXRL_PROCESS_ID=str(i),
                JAXRL_HEARTBEAT_TIMEOUT="10",  # the wait: 10 s + the exit
                PYTHONPATH=PYTHONPATH,
                **env,
            ),
            stdout=logs[i].open("w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    survivor = workers[1 - victim]
    try:
        deadline = time.monotonic() + 300
        while not ready():
            assert time.monotonic() < deadline, logs[1 - victim].read_text()[-3000:]
            assert all(w.poll() is None for w in workers), logs[1 - victim].read_text()[-3000:]
            time.sleep(0.002)
        workers[victim].send_signal(signal.SIGKILL)
        start = time.monotonic()
        rc = survivor.wait(timeout=90)
        waited = time.monotonic() - start
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    text = logs[1 - victim].read_text()
    assert rc != 0, text[-3000:]
    return text, waited
