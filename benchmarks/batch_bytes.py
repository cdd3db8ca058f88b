"""Issue 41, item 4: where the step's batch lives, W3 on 8 fake CPU devices, before and after.

    python benchmarks/batch_bytes.py [--size M] [--processes 2]

W3's step (32 prompts x 64 tokens, n = 4, 128 response tokens; WORKLOADS.md) of model `size`,
built as an abstract cluster over 8 fake CPU devices (`mesh.fsdp=8`; nothing allocated, only
config.json read). Figures, bytes:

- `batch_bytes_per_device`: the step's `RLBatch` on one device as the memory plan counts it
  (`PPOTrainer.memory_plan().batch`: its rows split over dp x fsdp = 8), and `before`: the
  same replicated (every device held all of it);
- `host_bytes_per_process_per_step` for `--processes` P, from the shapes (not timed), what
  crosses a process's host in a step around the batch (generation's outputs aside):
  - after: the other processes' row index (prompt and response lengths, int32, which plan
    the micro-batches), its own rows read back from its devices, and the other processes'
    row summaries for the metrics (`row_summaries`: float64 per row);
  - before: the rows every other process gathered to it (`gather_processes`: the generated
    and scored rows, (P - 1) / P of them), and the whole batch's read-back on every process.

JSON on the last line.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from common import emit, machine, workload_hf_config
from grpo_step import NEW, PROMPT_LEN, PROMPTS, N


def figures(size: str, processes: int) -> dict:
    from jaxrl.config import load_config
    from jaxrl.trainer.metrics import row_summaries
    from jaxrl.trainer.ppo_trainer import PPOTrainer

    with tempfile.TemporaryDirectory() as folder:
        workload_hf_config(size).save_pretrained(folder)
        overrides = [
            f"actor_rollout_ref.model.path={folder}",
            f"data.train_batch_size={PROMPTS}",
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={NEW}",
            f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.rollout.ignore_eos=true",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "algorithm.adv_estimator=grpo",
            "mesh.fsdp=8",
        ]
        cfg = load_config(None, overrides, num_devices=8)
        trainer = PPOTrainer.create(cfg, None, total_steps=10, abstract=True)
        plan = trainer.memory_plan()
        fields = trainer.plan.held_fields
    rows = PROMPTS * N
    others = rows * (processes - 1) // processes
    # the gathered rows: prompts and mask [N, P], responses and mask [N, R], group ids [N],
    # token scores and the rollout's log-probs float32 [N, R] (all 4-byte)
    gathered = 4 * rows * (2 * PROMPT_LEN + 4 * NEW + 1)
    summaries = len(row_summaries(_one_row(), use_critic=False))  # GRPO: no critic
    return {
        "rows": rows,
        "batch_fields": list(fields),
        "batch_bytes_per_device": {"after": plan.batch, "before": plan.batch * 8},
        "processes": processes,
        "host_bytes_per_process_per_step": {
            "after": {
                "row_index_from_others": 2 * 4 * others,
                "own_rows_read_back": plan.batch * 8 // processes,
                "row_summaries_from_others": summaries * 8 * others,
            },
            "before": {
                "gathered_from_others": gathered * (processes - 1) // processes,
                "batch_read_back": plan.batch * 8,  # no teacher top-k (kept on the devices)
            },
        },
    }


def _one_row() -> dict:
    """A one-row host batch with every field `row_summaries` reads."""
    import numpy as np

    one = np.ones((1, 2), np.float32)
    names = ("prompt_mask", "response_mask", "token_level_scores", "token_level_rewards",
             "advantages", "returns", "values")  # fmt: skip
    return dict.fromkeys(names, one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="M")
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    emit({"workload": "W3 batch bytes", "size": args.size, **figures(args.size, args.processes),
          "machine": machine()})  # fmt: skip


if __name__ == "__main__":
    main()
