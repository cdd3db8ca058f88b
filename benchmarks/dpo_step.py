"""One DPO step of jaxrl's trainer beside TRL 1.16's `DPOTrainer`, same model, data and work.

    python benchmarks/dpo_step.py [--size M] [--pairs 64] [--prompt-len 256]
                                  [--completion-len 256] [--micro 8] [--repeats 2]

Model `--size` of WORKLOADS.md (random Qwen2, float32), a word-level tokenizer over its 32000
ids, and `--pairs` random string pairs: a prompt of `--prompt-len` tokens, chosen and rejected
completions of `--completion-len` tokens (+ EOS). One step = the reference's log-probs of the
64 pairs (a frozen copy of the model), the policy's forward and backward over all 128
sequences in micro-batches of `--micro` pairs (chosen and rejected in one forward), one
AdamW step (sigmoid loss, beta 0.1, lr 1e-6, clip 1.0). Median of `--repeats` steps after one
warm-up step, for each; TRL with the same thread count, float32, `adamw_torch`, gradient
accumulation over the micro-batches, no gradient checkpointing. JSON on the last line:
seconds per step of each and the ratio (TRL / jaxrl). Each framework's step times also go to
stderr the moment it finishes (a long run cut short keeps jaxrl's figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import emit, machine, workload_checkpoint

VOCAB = 32000


def word_tokenizer(folder: Path):
    """A word-level tokenizer whose word `t{i}` is id i (0 pad, 1 EOS), saved to `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(str(folder))
    return folder


def pairs(n: int, prompt_len: int, completion_len: int) -> list[dict[str, str]]:
    import numpy as np

    rng = np.random.default_rng(0)

    def text(k):
        return " ".join(f"t{i}" for i in rng.integers(2, VOCAB, k))

    return [
        {"prompt": text(prompt_len), "chosen": " " + text(completion_len),
         "rejected": " " + text(completion_len)}
        for _ in range(n)
    ]  # fmt: skip


def bench_jaxrl(model: Path, tokenizer: Path, data: Path, args, run_dir: Path) -> list[float]:
    import jax

    from jaxrl.config.load import load_config
    from jaxrl.config.offline import DPO
    from jaxrl.trainer.offline import build_preference_run

    overrides = [
        f"model.path={model}", f"model.tokenizer_path={tokenizer}", "model.model_dtype=fp32",
        "model.dtype=fp32", "model.enable_gradient_checkpointing=false",
        f"data.train_files={data}", f"data.train_batch_size={args.pairs}",
        f"data.micro_batch_size_per_gpu={args.micro}", "data.shuffle=false",
        "dpo.max_length=null", "optim.lr_scheduler_type=constant", "mesh.fsdp=1",
        f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip
    cfg = load_config(None, overrides, num_devices=1, schema=DPO)
    run = build_preference_run(cfg, jax.devices()[:1])
    times = []
    for step in range(1, args.repeats + 2):
        batch = next(run.train_loader)
        start = time.perf_counter()
        metrics = run.trainer.step(batch, step)  # reads the metrics back: blocks until done
        times.append(time.perf_counter() - start)
        assert metrics["loss"] > 0
    return times[1:]


def bench_trl(model: Path, tokenizer: Path, records, args, out: Path) -> list[float]:
    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    torch.set_num_threads(os.cpu_count() or 1)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    config = trl.DPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.pairs // args.micro, max_steps=args.repeats + 1,
        learning_rate=1e-6, lr_scheduler_type="constant", optim="adamw_torch",
        weight_decay=0.0, max_grad_norm=1.0, bf16=False, use_cpu=True,
        gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=1,
        max_length=None, beta=0.1, loss_type=["sigmoid"], dataloader_num_workers=0,
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=str(model), args=config, train_dataset=datasets.Dataset.from_list(records),
        processing_class=AutoTokenizer.from_pretrained(str(tokenizer)), callbacks=[Timer()],
    )  # fmt: skip
    trainer.train()
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="M")
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-trl", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from jaxrl.data.rows import write_parquet

    model = workload_checkpoint(args.size)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = word_tokenizer(tmp / "tokenizer")
        records = pairs(args.pairs, args.prompt_len, args.completion_len)
        data = write_parquet(records, tmp / "pairs.parquet")
        jaxrl_s = bench_jaxrl(model, tokenizer, data, args, tmp / "run")
        print(json.dumps({"jaxrl_all_s": jaxrl_s}), file=sys.stderr, flush=True)
        trl_s = [] if args.no_trl else bench_trl(model, tokenizer, records, args, tmp / "trl")
        print(json.dumps({"trl_all_s": trl_s}), file=sys.stderr, flush=True)
    result = {
        "benchmark": "dpo_step",
        "size": args.size,
        "pairs": args.pairs,
        "prompt_len": args.prompt_len,
        "completion_len": args.completion_len,
        "micro_pairs": args.micro,
        "jaxrl_s": statistics.median(jaxrl_s),
        "jaxrl_all_s": jaxrl_s,
        **machine(),
    }
    if trl_s:
        trl_median = statistics.median(trl_s)
        result.update(trl_s=trl_median, trl_all_s=trl_s,
                      trl_over_jaxrl=trl_median / statistics.median(jaxrl_s))  # fmt: skip
    emit(result)


if __name__ == "__main__":
    main()
