"""Workload W3: one end-to-end GRPO step of jaxrl's trainer beside the same work in PyTorch.

    python benchmarks/grpo_step.py [--sizes S,M,MoE-S] [--no-torch]
    python benchmarks/grpo_step.py --lora 16 [--sizes S,M] [--memory-sizes M,L]

32 prompts x 64 random tokens, rollout.n = 4 (128 responses of exactly 128 tokens, EOS
ignored), reward = count of response tokens whose id % 10 == 7, GRPO advantages, one policy
forward + backward over all 128 sequences and one AdamW step (lr 1e-6, weight decay 0.01); no
reference, no KL, no old-log-prob pass (one mini-batch, one epoch: on-policy). Median of 3 steps
after 1 warm-up, split into generation, scoring and update. The update's FLOPs are
6 * N * 128 * 192 (N all parameters, tied embedding once; for a mixture of experts, `MoE-S`,
the parameters one token uses); its MFU is against the matmul peak measured in the same run.

The PyTorch peer (torch, same thread count) does the same work with the usual tools: HF
`generate` (sampling, min = max new tokens = 128) and a forward/backward of the same GRPO loss
with `torch.optim.AdamW` - the core of TRL's GRPOTrainer without its bookkeeping.

`--lora R`: the same step with LoRA rank R (alpha 2R, all-linear) beside full fine-tuning in
the same run (`--sizes`), and for `--memory-sizes` the compiled step's figures with and without
LoRA, measured from the compiled programs of an abstract cluster (nothing allocated): the
peak device memory of the step (`PPOTrainer.memory_plan`), the optimizer-state bytes, and the
bytes the weight sync writes per step (the reshard programs' outputs: the whole model without
LoRA, the adapters with it). JSON on the last line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import emit, hf_sample, machine, matmul_peak_flops, workload_checkpoint

PROMPTS, PROMPT_LEN, N, NEW = 32, 64, 4, 128


def rule_reward(responses, mask):
    """Count of response tokens with id % 10 == 7, on the last valid token."""
    import numpy as np

    scores = np.zeros(responses.shape, np.float32)
    counts = ((responses % 10 == 7) * mask).sum(-1)
    last = np.maximum(mask.sum(-1) - 1, 0)
    scores[np.arange(len(counts)), last] = counts
    return scores


def prompt_ids(vocab: int):
    import numpy as np

    return np.random.RandomState(0).randint(3, vocab, (PROMPTS, PROMPT_LEN)).astype(np.int32)


def bench_jaxrl(
    folder,
    micro: int | None,
    *,
    dtype: str = "float32",
    prompts: int = PROMPTS,
    new: int = NEW,
    mini_batches: int = 1,
    steps: int = 4,
    lora: int = 0,
) -> dict:
    """Median figures of `steps` - 1 GRPO steps after a warm-up. `dtype`: rollout and actor
    compute; `mini_batches` > 1 splits the update, so the step runs the old-log-prob pass
    (`log_prob_s`) too."""
    import numpy as np

    from jaxrl.data.batch import PromptBatch, object_array
    from jaxrl.trainer.ppo_trainer import PPOTrainer

    cfg = w3_config(folder, micro, dtype, prompts, new, mini_batches, lora)

    def reward(prompts, responses, mask):
        return rule_reward(responses, mask), {}, {}

    trainer = PPOTrainer.create(cfg, reward, total_steps=10)
    ids = prompt_ids(trainer.cluster.actor.config.vocab_size)[:prompts]
    b = prompts
    batch = PromptBatch(
        input_ids=ids,
        attention_mask=np.ones_like(ids),
        group_ids=np.arange(b, dtype=np.int32),
        uid=object_array([str(i) for i in range(b)]),
        row_ids=np.arange(b),
        data_source=object_array(["w3"] * b),
        ground_truth=object_array([""] * b),
        ability=object_array([""] * b),
        extra_info=object_array([{}] * b),
        raw_prompt=object_array([()] * b),
        is_padding=np.zeros(b, bool),
    )
    done = [trainer.step(batch, s) for s in range(1, steps + 1)]
    timed = done[1:]
    assert all(m["response_length/min"] == new for m in done)

    def med(key):
        return statistics.median(m.get(key, 0.0) for m in timed)

    return {
        "step_s": med("timing_s/step"),
        "generation_s": med("timing_s/gen"),
        "scoring_s": med("timing_s/reward"),
        "advantage_s": med("timing_s/adv"),
        "log_prob_s": med("timing_s/old_log_prob"),
        "update_s": med("timing_s/update_actor"),
        "first_step_s": done[0]["timing_s/step"],
    }


def w3_config(folder, micro, dtype="float32", prompts=PROMPTS, new=NEW, mini_batches=1, lora=0):
    """W3's config (`lora` > 0: LoRA of that rank, alpha 2·rank, on every projection)."""
    from jaxrl.config import load_config

    adapters = [
        f"actor_rollout_ref.model.lora_rank={lora}",
        f"actor_rollout_ref.model.lora_alpha={2 * lora}",
    ]
    return load_config(
        None,
        [
            *(adapters if lora else []),
            f"actor_rollout_ref.model.path={folder}",
            f"data.train_batch_size={prompts}",
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={new}",
            f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.rollout.ignore_eos=true",
            f"actor_rollout_ref.rollout.dtype={dtype}",
            f"actor_rollout_ref.actor.dtype={dtype}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts // mini_batches}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro or 'null'}",
            "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
            "actor_rollout_ref.actor.entropy_from_logits_chunk_size=2048",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.optim.weight_decay=0.01",
            "actor_rollout_ref.model.enable_gradient_checkpointing=false",
            "algorithm.adv_estimator=grpo",
        ],
        num_devices=1,
    )


def compiled_figures(size: str, micro: int | None, lora: int) -> dict:
    """The W3 step of model `size` compiled on an abstract cluster (only config.json is
    read): peak device memory, optimizer-state and resident bytes, and the bytes one weight
    sync writes (the reshard programs' outputs), all from XLA's analysis."""
    import tempfile

    import jax
    import numpy as np
    from common import workload_hf_config

    from jaxrl.sharding.reshard import reshard_report
    from jaxrl.trainer.ppo_trainer import PPOTrainer

    def nbytes(tree) -> int:
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    with tempfile.TemporaryDirectory() as folder:
        workload_hf_config(size).save_pretrained(folder)
        cfg = w3_config(folder, micro, lora=lora)
        trainer = PPOTrainer.create(cfg, None, total_steps=10, abstract=True)
        plan = trainer.memory_plan()
    actor, rollout = trainer.cluster.actor, trainer.cluster.rollout
    moved, targets = actor.params, rollout.shardings
    if lora:  # after the first step only the adapters are resharded
        from jaxrl.models.lora import split

        moved, targets = actor.state.params, split(targets)[1]
    sync = reshard_report(moved, targets, dtype=rollout.config.param_dtype)
    return {
        "peak_bytes": plan.peak,
        "optimizer_state_bytes": nbytes(actor.state.opt_state),
        "trained_param_bytes": nbytes(actor.state.params),
        "frozen_param_bytes": nbytes(actor.base),
        "sync_bytes_written_per_step": sync["bytes_written_per_device"],
        "largest_program": plan.largest,
    }


def bench_torch(folder) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    ids = torch.tensor(prompt_ids(model.config.vocab_size), dtype=torch.long).repeat_interleave(
        N, 0
    )

    def step() -> dict[str, float]:
        t0 = time.perf_counter()
        model.eval()
        out = hf_sample(model, ids, NEW)
        t1 = time.perf_counter()
        responses = out[:, PROMPT_LEN:].numpy()
        mask = np.ones_like(responses)
        scores = rule_reward(responses, mask).sum(-1).reshape(PROMPTS, N)
        std = scores.std(1, ddof=1, keepdims=True)
        adv = (scores - scores.mean(1, keepdims=True)) / (std + 1e-6)
        t2 = time.perf_counter()
        model.train()
        logits = model(out).logits[:, PROMPT_LEN - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, out[:, PROMPT_LEN:, None])[..., 0]
        ratio = torch.exp(lp - lp.detach())
        a = torch.tensor(adv.reshape(-1, 1), dtype=torch.float32)
        loss = (-a * ratio).mean()
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        t3 = time.perf_counter()
        return {"step_s": t3 - t0, "generation_s": t1 - t0, "scoring_s": t2 - t1,
                "update_s": t3 - t2}  # fmt: skip

    runs = [step() for _ in range(4)][1:]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="S,M")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--micro", type=int, default=32, help="ppo_micro_batch_size_per_gpu")
    parser.add_argument("--lora", type=int, default=0, help="also LoRA of this rank")
    parser.add_argument("--memory-sizes", default="M,L", help="with --lora: compiled figures")
    args = parser.parse_args()
    if args.lora:
        return lora_main(args)
    from jaxrl.models import load_config as model_config
    from jaxrl.models.params import parameter_counts

    peak = matmul_peak_flops()
    results = {}
    for size in args.sizes.split(","):
        folder = workload_checkpoint(size)
        entry = {"jaxrl": bench_jaxrl(folder, args.micro)}
        n_params = parameter_counts(model_config(folder))[1]
        flops = 6 * n_params * N * PROMPTS * (PROMPT_LEN + NEW)
        entry["update_flops"] = flops
        entry["jaxrl"]["update_mfu"] = flops / entry["jaxrl"]["update_s"] / peak
        if not args.no_torch:
            entry["torch"] = bench_torch(folder)
            entry["speedup_vs_torch"] = entry["torch"]["step_s"] / entry["jaxrl"]["step_s"]
        results[size] = entry
        print(size, entry, flush=True)
    emit({"workload": "W3", "prompts": PROMPTS, "n": N, "prompt_len": PROMPT_LEN,
          "new_tokens": NEW, "peak_flops": peak, "results": results,
          "machine": machine()})  # fmt: skip


def lora_main(args) -> None:
    """`--lora R`: full fine-tuning against LoRA rank R, step times and compiled figures."""
    results: dict = {"step": {}, "compiled": {}}
    for size in args.sizes.split(","):
        folder = workload_checkpoint(size)
        full = bench_jaxrl(folder, args.micro)
        adapted = bench_jaxrl(folder, args.micro, lora=args.lora)
        results["step"][size] = {
            "full": full,
            "lora": adapted,
            "step_ratio_lora_over_full": adapted["step_s"] / full["step_s"],
            "update_ratio_lora_over_full": adapted["update_s"] / full["update_s"],
        }
        print(size, results["step"][size], flush=True)
    for size in args.memory_sizes.split(","):
        full = compiled_figures(size, args.micro, 0)
        adapted = compiled_figures(size, args.micro, args.lora)
        results["compiled"][size] = {
            "full": full,
            "lora": adapted,
            "peak_ratio_lora_over_full": adapted["peak_bytes"] / full["peak_bytes"],
            "optimizer_state_ratio": adapted["optimizer_state_bytes"]
            / full["optimizer_state_bytes"],
            "sync_bytes_ratio": adapted["sync_bytes_written_per_step"]
            / full["sync_bytes_written_per_step"],
        }
        print(size, results["compiled"][size], flush=True)
    emit({"workload": "W3-lora", "lora_rank": args.lora, "prompts": PROMPTS, "n": N,
          "prompt_len": PROMPT_LEN, "new_tokens": NEW, "results": results,
          "machine": machine()})  # fmt: skip


if __name__ == "__main__":
    main()
