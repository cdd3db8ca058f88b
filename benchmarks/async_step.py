"""Asynchronous RL: GRPO steps with the rollout and the trainer each in its own process, one
core each, synchronous against `async_training.mode=one_step_off` (`docs/async.md`).

    python benchmarks/async_step.py [--steps 10] [--prompts 8] [--n 8] [--max-tokens 256]
                                    [--eos-scale 32] [--quickstart-steps 0]
                                    [--quickstart-seeds 0]
                                    [--layouts two_processes,one_process]
                                    [--modes sync,one_step_off,fully_async]

Two JAX processes (`launch/local.sh 2`, one CPU device each, each pinned to its own core):
the actor trains on process 0's device and the rollout generates on process 1's
(`mesh.placement.spread=false mesh.placement.rollout.devices=1`).

Workload: model S (WORKLOADS.md) whose end token's (tied) embedding row is a random unit
direction times `--eos-scale`, so each response ends when its hidden state points that way:
most responses are short and a few run to `--max-tokens` (the long tail of RL rollouts; the
lengths are reported). `--prompts` random prompts of 32 tokens per step, `rollout.n`
responses each, GRPO on a rule reward (response tokens whose id % 10 == 7), one mini-batch,
in every mode `algorithm.rollout_correction.bypass_mode=true` (verl's one_step_off recipe
default: the rollout's log-probs are the old ones, no old-log-prob pass). Figures per mode,
over the steps after the first two (compiles): samples (responses) per second, seconds per
step, each side's idle fraction (sync: the trainer idles while generating, the rollout while
training; the async modes: their `async/*` metrics), and each async mode's samples per
second over sync's.

`--quickstart-steps K` also trains the quickstart task (`configs/quickstart.yaml`) for K steps
in each mode on the same two processes, once per `--quickstart-seeds` (`data.seed`; the
modes in turn for each seed), every mode with `algorithm.rollout_correction.bypass_mode=true`
(as the steps above: the async modes clip against the rollout's own log-probs instead of
recomputing them, a pass as long as the quickstart's whole generation), validating every
10, and reports per seed the wall seconds until validation accuracy first reaches 1.0 (null:
not within K steps), the step it came at and the median seconds per step; per mode the
median solved seconds and, for the async modes, on how many seeds they solved it no later
than sync did. `--layouts ""` runs the quickstart only.

`fully_async` runs with `trigger_parameter_sync_step=1` and `staleness_threshold=1.0` (two
steps of groups a weights version: the rollouter may run a step ahead). The same modes also
run in one process of 2 CPU devices (both cores shared; `--layouts` picks). JSON on the last
line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT_LEN = 32
MODES = {
    "sync": [],
    "one_step_off": ["async_training.mode=one_step_off"],
    "fully_async": ["async_training.mode=fully_async",
                    "async_training.trigger_parameter_sync_step=1",
                    "async_training.staleness_threshold=1.0"],  # 2 steps of groups a version
}  # fmt: skip
PLACED = ["mesh.placement.spread=false", "mesh.placement.rollout.devices=1"]
# where the modes run: 2 processes x 1 device (one core each), and 1 process x 2 devices
# (both cores, shared)
LAYOUTS = ("two_processes", "one_process")


# ----------------------------------------------------------------------------- the workload


def long_tail_model(folder: Path, eos_scale: float) -> Path:
    """Model S with its end token's embedding row set to `eos_scale` x a random unit vector
    (seeded), saved as an HF folder."""
    import numpy as np
    import torch
    from transformers import Qwen2ForCausalLM

    sys.path.insert(0, str(HERE))
    from common import workload_checkpoint

    model = Qwen2ForCausalLM.from_pretrained(str(workload_checkpoint("S")))
    eos = model.config.eos_token_id
    direction = np.random.default_rng(0).standard_normal(model.config.hidden_size)
    direction *= eos_scale / np.linalg.norm(direction)
    with torch.no_grad():
        model.model.embed_tokens.weight[eos] = torch.tensor(direction, dtype=torch.float32)
    model.save_pretrained(str(folder))
    return folder


class RandomPrompts:
    """This process's rows of each step's random prompts (row r: ids in [3, 32000) seeded by
    r), with what the trainer's async modes use of a train loader: `peek`, `dataset.batch`
    (rows by number), `state_dict`, `global_view`."""

    def __init__(self, prompts: int, index: int | None = None, count: int | None = None):
        import jax

        self.prompts, self.position, self.dataset = prompts, 0, self
        self.index = jax.process_index() if index is None else index
        self.count = jax.process_count() if count is None else count

    def global_view(self) -> RandomPrompts:
        view = RandomPrompts(self.prompts, 0, 1)
        view.position = self.position
        return view

    def batch(self, rows, *, group_offset: int = 0, uid_prefix: str = ""):
        import numpy as np

        from jaxrl.data.batch import PromptBatch, object_array

        rows = np.asarray(rows, np.int64)
        ids = np.stack([np.random.default_rng([int(r)]).integers(3, 32000, PROMPT_LEN)
                        for r in rows]).astype(np.int32)  # fmt: skip
        b = len(rows)
        return PromptBatch(
            input_ids=ids,
            attention_mask=np.ones_like(ids),
            group_ids=np.arange(group_offset, group_offset + b, dtype=np.int32),
            uid=object_array([f"{uid_prefix}{r}" for r in rows]),
            row_ids=rows,
            data_source=object_array(["async"] * b),
            ground_truth=object_array([""] * b),
            ability=object_array([""] * b),
            extra_info=object_array([{}] * b),
            raw_prompt=object_array([()] * b),
            is_padding=np.zeros(b, bool),
        )

    def _rows(self, position: int):
        per = self.prompts // self.count
        first = position * self.prompts + self.index * per
        return range(first, first + per)

    def peek(self):
        return self.batch(self._rows(self.position), group_offset=self._rows(0).start)

    def __next__(self):
        self.position += 1
        return self.batch(self._rows(self.position - 1), group_offset=self._rows(0).start)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def rule_reward(prompts, responses, mask):
    """Response tokens with id % 10 == 7, on the last valid token."""
    import numpy as np

    scores = np.zeros(responses.shape, np.float32)
    counts = ((responses % 10 == 7) * mask).sum(-1)
    scores[np.arange(len(counts)), np.maximum(mask.sum(-1) - 1, 0)] = counts
    return scores, {}, {}


def step_overrides(args, model: Path) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={PROMPT_LEN}",
        f"data.max_response_length={args.max_tokens}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.bypass_mode=true",  # verl's one_step_off recipe default
        "trainer.logger=[]",
        *PLACED,
    ]


# -------------------------------------------------------------------------------- workers


def pin() -> None:
    """With several processes, this one on its own core (process i on core i of those it
    may use): every thread the process has, JAX's compute threads included. Call it after
    JAX's backend is up: its thread pools are sized then by the cores the process may use,
    and a pool of one thread deadlocks a cross-process collective waiting on a transfer."""
    if "JAXRL_NUM_PROCESSES" not in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    core = {cores[int(os.environ.get("JAXRL_PROCESS_ID", "0")) % len(cores)]}
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), core)


def steps_worker(args) -> None:
    """GRPO steps of the long-tailed workload; process 0 writes each step's metrics."""
    from jaxrl import distributed

    distributed.initialize()
    import jax

    jax.devices()  # the backend and its threads, before the pinning
    pin()

    from jaxrl.config import load_config
    from jaxrl.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(None, [*step_overrides(args, Path(args.model)), *args.overrides],
                      num_devices=jax.device_count())  # fmt: skip
    source = RandomPrompts(args.prompts)
    trainer = PPOTrainer.create(cfg, rule_reward, total_steps=args.steps, prompt_source=source)
    rows = []
    for step in range(1, args.steps + 1):
        rows.append(trainer.step(next(source), step))
        print(f"step {step}: {rows[-1]['timing_s/step']:.2f} s", file=sys.stderr, flush=True)
    trainer.close()
    if jax.process_index() == 0:
        Path(args.out).write_text(json.dumps(rows))


def quickstart_worker(args) -> None:
    """The quickstart run (its own `jaxrl.train` entry, on this core)."""
    from jaxrl import distributed

    distributed.initialize()  # idempotent: the entry's own call returns this one
    import jax

    jax.devices()
    pin()
    from jaxrl.train import main

    sys.exit(main(["--config", str(ROOT / "configs/quickstart.yaml"), *args.overrides]))


def launch(worker: str, args: list[str], log_dir: Path, *, processes: int = 2) -> None:
    """The worker on `processes` processes of 1 device each (`launch/local.sh`), or on one
    process of 2 devices (`processes=1`)."""
    command = f"{sys.executable} {__file__} --worker {worker}"
    env = {**os.environ, "PYTHON": sys.executable, "JAXRL_QUIET": "1"}
    if processes == 1:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        argv, cwd = [*command.split(), *args], ROOT
    else:
        env.update(JAXRL_LOCAL_DEVICES="1", JAXRL_LOG_DIR=str(log_dir), JAXRL_LAUNCH_CMD=command,
                   XLA_FLAGS="")  # fmt: skip
        argv, cwd = ["bash", str(ROOT / "launch/local.sh"), str(processes), *args], ROOT
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        logs = "".join(p.read_text()[-3000:] for p in sorted(log_dir.glob("*.log")))
        raise RuntimeError(f"{worker} run failed ({done.stderr[-3000:]}):\n{logs}")


# ---------------------------------------------------------------------------------- driver


def figures(rows: list[dict], mode: str) -> dict:
    """Medians over the steps after the first two."""
    timed = rows[2:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    out = {
        "step_s": med("timing_s/step"),
        "response_length_mean": statistics.mean(r["response_length/mean"] for r in timed),
        "response_length_max": max(r["response_length/max"] for r in timed),
        "clip_ratio": statistics.mean(r["response_length/clip_ratio"] for r in timed),
    }
    if mode == "sync":
        out["trainer_idle"] = med("timing_s/gen") / out["step_s"]
        out["rollout_idle"] = 1 - out["trainer_idle"]
    else:
        out["trainer_idle"] = med("async/trainer/idle_ratio")
        out["rollout_idle"] = med("async/rollout/idle_ratio")
        out["staleness_mean"] = statistics.mean(r["async/staleness/mean"] for r in timed)
    return out


def first_solved(run_dir: Path) -> dict[str, float | None]:
    """The first validation with accuracy 1.0: its wall seconds (`timing_s/elapsed`) and step
    (None: none), and the run's median seconds per step."""
    sys.path.insert(0, str(ROOT))
    from jaxrl.trainer.loggers import read_metrics

    rows = read_metrics(run_dir)
    steps_s = [r["timing_s/step"] for r in rows if "timing_s/step" in r]
    solved = {"solved_s": None, "solved_step": None, "step_s": statistics.median(steps_s)}
    for row in rows:
        acc = [v for k, v in row.items() if k.startswith("val-core/") and k.endswith("/mean@1")]
        if acc and min(acc) >= 1.0:
            solved.update(
                solved_s=row.get("timing_s/elapsed"), solved_step=row.get("training/global_step")
            )
            break
    return solved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("steps", "quickstart"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--eos-scale", type=float, default=32.0)
    parser.add_argument("--quickstart-steps", type=int, default=0)
    parser.add_argument("--quickstart-seeds", default="0", help="data.seed of each run: 0,1,2")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="of " + ",".join(LAYOUTS))
    parser.add_argument("--modes", default=",".join(MODES), help="of " + ",".join(MODES))
    parser.add_argument("--model")
    parser.add_argument("--out")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.worker == "steps":
        return steps_worker(args)
    if args.worker == "quickstart":
        return quickstart_worker(args)

    sys.path.insert(0, str(HERE))
    from common import emit, machine

    result = {
        "benchmark": "async_step",
        "model": "S",
        "eos_scale": args.eos_scale,
        "prompts": args.prompts,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "steps": args.steps,
        "layouts": {
            "two_processes": "2 processes x 1 CPU device, one core each: the actor on "
            "process 0, the rollout on process 1",
            "one_process": "1 process x 2 CPU devices (the actor on one, the rollout on the "
            "other), both cores shared",
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = long_tail_model(tmp / "model", args.eos_scale)
        modes = tuple(args.modes.split(","))
        unknown = sorted(set(modes) - set(MODES))
        if unknown or modes[0] != "sync":
            raise SystemExit(
                f"--modes {args.modes}: sync first (the ratios are to it), then "
                f"any of {list(MODES)[1:]}"
            )
        for layout in filter(None, args.layouts.split(",")):  # "": the quickstart only
            processes = 2 if layout == "two_processes" else 1
            result[layout] = {}
            for mode in modes:
                out = tmp / f"{layout}-{mode}.json"
                worker_args = ["--steps", str(args.steps), "--prompts", str(args.prompts),
                               "--n", str(args.n), "--max-tokens", str(args.max_tokens),
                               "--model", str(model), "--out", str(out), *MODES[mode]]  # fmt: skip
                launch("steps", worker_args, tmp / f"logs-{layout}-{mode}", processes=processes)
                figures_ = figures(json.loads(out.read_text()), mode)
                figures_["samples_per_s"] = args.prompts * args.n / figures_["step_s"]
                result[layout][mode] = figures_
                print(layout, mode, figures_, flush=True)
            rates = {mode: result[layout][mode]["samples_per_s"] for mode in modes}
            for mode in modes[1:]:
                result[layout][f"{mode}_speedup"] = rates[mode] / rates["sync"]
        seeds = [int(s) for s in args.quickstart_seeds.split(",")] if args.quickstart_steps else []
        for seed in seeds:  # the modes in turn for each seed: the host's load drifts alike
            for mode in modes:
                run_dir = tmp / f"quickstart-{mode}-{seed}"
                launch("quickstart", [
                    f"trainer.total_training_steps={args.quickstart_steps}", f"data.seed={seed}",
                    "trainer.test_freq=10", "trainer.save_freq=-1", "trainer.logger=[]",
                    f"trainer.default_local_dir={run_dir}", *PLACED, *MODES[mode],
                    "algorithm.rollout_correction.bypass_mode=true",
                ], tmp / f"logs-quickstart-{mode}-{seed}")  # fmt: skip
                runs = result.setdefault(f"quickstart_{mode}", {"seeds": {}})
                runs["seeds"][seed] = first_solved(run_dir)
                print("quickstart", mode, seed, runs["seeds"][seed], flush=True)
        for mode in modes if seeds else ():
            runs = result[f"quickstart_{mode}"]
            solved = [r["solved_s"] for r in runs["seeds"].values()]
            # a seed not solved within the steps counts as later than any solved one
            runs["solved_s_median"] = statistics.median(s or float("inf") for s in solved)
            runs["solved_all"] = None not in solved
            if mode != "sync":
                sync_seeds = result["quickstart_sync"]["seeds"]
                runs["no_later_than_sync"] = sum(
                    (r["solved_s"] or float("inf")) <= (sync_seeds[s]["solved_s"] or float("inf"))
                    and r["solved_s"] is not None
                    for s, r in runs["seeds"].items()
                )
    emit({**result, "machine": machine()})


if __name__ == "__main__":
    main()
