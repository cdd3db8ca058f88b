"""One GRPO step of the real-weights example (SmolLM2-135M-Instruct on reasoning-gym's
`gsm_symbolic`), phase by phase against its roof, beside TRL's `GRPOTrainer` in the same run.

    python benchmarks/real_step.py [--steps 3] [--gradient-checkpointing off|on] [--no-trl]
        [--model ~/.cache/jaxrl/smollm2-135m-instruct] [--data ~/data/rg_gsm_symbolic]
    python benchmarks/real_step.py --smoke --data /tmp/rs_data --new-tokens 16 --steps 2

jaxrl: the run `python -m jaxrl.train --config configs/grpo_smollm2_reasoning_gym.yaml` builds
(`load_config` + `build_run`): 8 prompts x 4 responses, a reference model with a low_var_kl
KL loss (coef 0.001), lr 1e-6, float32, micro-batches of 4 sequences, one mini-batch (on policy:
no old-log-prob pass). Overridden: the model and data folders, `rollout.ignore_eos=true` so
that every response is exactly 256 tokens (fixed work, comparable with TRL forced to
min_new_tokens = max_new_tokens = 256), gradient checkpointing from the flag (the example turns
it on; the flag's default is off), no loggers, no validation, a temporary run directory.
`steps` calls of `trainer.step`; each phase is the median over steps 2.. of the trainer's
`timing_s/*` (generation includes the weight sync into the rollout). Compile time is the first
step's time minus the median step's; the XLA programs each step builds are the trainer's
`perf/compiles` (`jaxrl.trainer.compiles`; `compiles_per_step`: none expected after step 2).

TRL (`trl.GRPOTrainer`, torch on the CPU, all cores): the same model folder (float32), the
same prompts in the same order (the rows jaxrl's loader drew, as conversational prompts), 4
completions of exactly 256 tokens per prompt (`min_new_tokens`), temperature 1, beta 0.001
(a reference model), lr 1e-6 constant, AdamW weight decay 0.01 and gradient clip 1 (jaxrl's
defaults), micro-batches of 4 with 8 accumulation steps (one generation of 32 completions per
optimizer step, no old-log-prob pass), verl's strict GSM8K scorer as the reward, gradient
(activation) checkpointing from the flag. Off CUDA, TRL's fused LM head scores every position
(prompt and padding too), not only the response's: more work than the roof counts. Phases
are timed by wrapping the trainer's methods: `_generate`, `_calculate_rewards`,
`_get_per_token_logps_and_entropies` inside `_generate_and_score_completions` (ref and old
passes), the optimizer step by a callback; update = step - generate-and-score.

FLOPs (useful work, from the model's config.json and the step's token counts). With d hidden,
L layers, H heads, K kv heads, h head_dim, F the MLP width and V the vocabulary, a layer's
matmul weights are W = 2 d H h + 2 d K h + 3 d F, and N_matmul = L W + V d (the tied
embedding counted once, as the head; the lookup is free). A causal forward over T tokens
whose last c positions produce logits costs

    forward(T, c) = 2 L W T + 2 V d c + 2 L H h T (T + 1)

(Q K^T and A V take 2 H h FLOPs each per query-key pair, T (T + 1) / 2 pairs). Per response
of prompt length P and R = 256 new tokens: generation = forward(P + R - 1, R) (prefill of the
prompt, then R - 1 decode steps each feeding the last sampled token; the KV cache makes
decode attention the same causal pairs); a log-prob pass = forward(P + R, R) (logits needed
at the response positions only); update = 3 forward(P + R, R) (forward + backward; the
recompute of gradient checkpointing is not useful work). `fraction_of_matmul_peak` is the
median over steps 2.. of flops / seconds / peak, the peak being a float32 2048^3 matmul
measured in the same run. Generation at this batch is bound by memory bandwidth rather than
matmul: `decode_bytes_per_step` is what one decode step reads (every parameter, float32, plus
the mean KV cache of the batch), `decode_bytes_per_second` that times R over the generation
time. JSON on the last line.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from common import emit, machine, matmul_peak_flops

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "grpo_smollm2_reasoning_gym.yaml"
N = 4  # responses per prompt (the example's rollout.n)
# report name -> the trainer's timing key (`timing_s/<key>`; jaxrl/trainer/ppo_trainer.py)
PHASES = {
    "generation": "gen",
    "scoring": "reward",
    "old_log_prob": "old_log_prob",
    "ref_log_prob": "ref",
    "advantage": "adv",
    "update": "update_actor",
    "step": "step",
}
LOG_PROB_PHASES = ("old_log_prob", "ref_log_prob")
BYTES = 4  # float32


# ------------------------------------------------------------------------------------ roofs


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's sizes, from its HF config.json."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool

    @classmethod
    def from_folder(cls, folder: Path) -> Shape:
        c = json.loads((folder / "config.json").read_text())
        heads = c["num_attention_heads"]
        return cls(
            layers=c["num_hidden_layers"],
            hidden=c["hidden_size"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            ffn=c["intermediate_size"],
            vocab=c["vocab_size"],
            tied=c.get("tie_word_embeddings", False),
        )

    @property
    def layer_weights(self) -> int:
        """W = 2 d H h (q, o) + 2 d K h (k, v) + 3 d F (gate, up, down)."""
        d, h = self.hidden, self.head_dim
        return 2 * d * self.heads * h + 2 * d * self.kv_heads * h + 3 * d * self.ffn

    @property
    def matmul_params(self) -> int:
        """N_matmul = L W + V d."""
        return self.layers * self.layer_weights + self.vocab * self.hidden

    @property
    def param_bytes(self) -> int:
        """Every parameter (the norms too, an untied embedding apart from the head)."""
        norms = (2 * self.layers + 1) * self.hidden
        embedding = 0 if self.tied else self.vocab * self.hidden
        return (self.matmul_params + norms + embedding) * BYTES

    def forward(self, tokens: int, logits: int) -> int:
        """forward(T, c) = 2 L W T + 2 V d c + 2 L H h T (T + 1)."""
        attention = 2 * self.layers * self.heads * self.head_dim * tokens * (tokens + 1)
        matmul = 2 * self.layers * self.layer_weights * tokens
        return matmul + 2 * self.vocab * self.hidden * logits + attention

    def kv_bytes(self, context: float) -> float:
        """KV cache of one sequence at `context` tokens: 2 L K h context values."""
        return 2 * self.layers * self.kv_heads * self.head_dim * context * BYTES


def phase_flops(shape: Shape, prompt_lengths: list[int], new: int) -> dict[str, int]:
    """FLOPs of each phase of a step whose responses have these prompt lengths (one entry per
    response) and `new` tokens each (the module doc's formulas)."""
    generation = sum(shape.forward(p + new - 1, new) for p in prompt_lengths)
    log_prob = sum(shape.forward(p + new, new) for p in prompt_lengths)
    flops = {"generation": generation, "update": 3 * log_prob}
    flops.update({name: log_prob for name in LOG_PROB_PHASES})
    return flops


def decode_bytes(shape: Shape, prompt_lengths: list[int], new: int) -> float:
    """Bytes one decode step reads: every parameter, plus the batch's KV cache at its mean
    context over the R steps (P + (R - 1) / 2)."""
    cache = sum(shape.kv_bytes(p + (new - 1) / 2) for p in prompt_lengths)
    return shape.param_bytes + cache


def phase_report(
    steps: list[dict[str, float]], flops: list[dict[str, int]], peak: float
) -> dict[str, dict]:
    """Per phase over the timed steps (`steps[i]`: phase -> seconds, `flops[i]`: phase ->
    FLOPs): median seconds and FLOPs, and the median of flops / seconds / peak. The step's
    FLOPs are the sum of the phases it ran (a log-prob pass the step skipped counts nothing)."""
    out: dict[str, dict] = {}
    for phase in PHASES:
        present = [(s, f) for s, f in zip(steps, flops, strict=True) if s.get(phase)]
        if not present:
            continue
        seconds = [s[phase] for s, _ in present]
        entry: dict = {"seconds": statistics.median(seconds)}
        work = [_phase_work(phase, s, f) for s, f in present]
        if all(w is not None for w in work):
            entry["flops"] = statistics.median(work)
            entry["fraction_of_matmul_peak"] = statistics.median(
                w / t / peak for w, t in zip(work, seconds, strict=True)
            )
        out[phase] = entry
    return out


def _phase_work(phase: str, seconds: dict, flops: dict) -> int | None:
    if phase != "step":
        return flops.get(phase)
    return sum(f for name, f in flops.items() if seconds.get(name))


def generation_bytes(report: dict, shape: Shape, prompt_lengths: list[int], new: int) -> None:
    """Adds the decode step's bytes and the bandwidth they imply to the generation entry."""
    if "generation" not in report:
        return
    per_step = decode_bytes(shape, prompt_lengths, new)
    report["generation"]["decode_bytes_per_step"] = per_step
    report["generation"]["decode_bytes_per_second"] = (
        per_step * new / report["generation"]["seconds"]
    )


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


# ----------------------------------------------------------------------------------- jaxrl


def jaxrl_overrides(args, run_dir: str) -> list[str]:
    checkpointing = "true" if args.gradient_checkpointing == "on" else "false"
    return [
        f"actor_rollout_ref.model.path={args.model}",
        f"data.train_files={args.data / 'train.parquet'}",
        f"data.val_files={args.data / 'test.parquet'}",
        f"data.max_response_length={args.new_tokens}",
        "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}",
        "trainer.logger=[]",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={run_dir}",
    ]


def jaxrl_config(args, run_dir: str):
    """The example's config as `python -m jaxrl.train` loads and checks it, with the
    overrides."""
    import jax

    from jaxrl.config import ConfigError, load_config
    from jaxrl.train import preflight_problems

    overrides = jaxrl_overrides(args, run_dir)
    cfg = load_config(CONFIG, overrides, num_devices=jax.device_count())
    if problems := preflight_problems(cfg):
        raise ConfigError(problems)
    return cfg


def prompt_rows(batch) -> list[dict]:
    """The batch's prompts as TRL rows: conversational `prompt`, `ground_truth`."""
    return [
        {"prompt": [dict(m) for m in messages], "ground_truth": str(truth)}
        for messages, truth in zip(batch.raw_prompt, batch.ground_truth, strict=True)
    ]


def bench_jaxrl(args, shape: Shape, peak: float) -> tuple[dict, list[dict]]:
    """The jaxrl figures, and the prompts of its steps (TRL rows, in order)."""
    from jaxrl.trainer.fit import build_run

    with tempfile.TemporaryDirectory() as run_dir:
        run = build_run(jaxrl_config(args, run_dir))
        done, rows, lengths = [], [], []
        try:
            for s in range(1, args.steps + 1):
                batch = next(run.train_loader)
                done.append(run.trainer.step(batch, s))
                rows += prompt_rows(batch)
                lengths.append([int(p) for p in batch.attention_mask.sum(1) for _ in range(N)])
                print(f"jaxrl step {s}: {done[-1]['timing_s/step']:.1f} s", flush=True)
        finally:
            run.trainer.close()
    keys = sorted(k for k in done[-1] if k.startswith("timing_s/"))
    print("jaxrl timing keys:", keys, flush=True)
    seconds = [{p: m.get(f"timing_s/{k}", 0.0) for p, k in PHASES.items()} for m in done]
    flops = [phase_flops(shape, p, args.new_tokens) for p in lengths]
    report = phase_report(seconds[1:], flops[1:], peak)
    generation_bytes(report, shape, lengths[-1], args.new_tokens)
    steps = [m["timing_s/step"] for m in done]
    result = {
        "phases": report,
        "timing_keys": keys,
        "step_s_per_step": steps,
        "compile_s": steps[0] - median_after_first(steps),
        "compiles_per_step": [m["perf/compiles"] for m in done],
        "compile_seconds_per_step": [m["perf/compile_s"] for m in done],
        "compiles_from_step_3": sum(m["perf/compiles"] for m in done[2:]),
        "response_length_min": min(m["response_length/min"] for m in done),
        "response_length_max": max(m["response_length/max"] for m in done),
        "prompt_tokens_per_step": [sum(p) for p in lengths],
    }
    return result, rows


# ------------------------------------------------------------------------------------- TRL


def gsm8k_reward(completions, ground_truth, **_) -> list[float]:
    """verl's strict GSM8K score of each completion (TRL passes the dataset's other columns,
    here `ground_truth`, as keyword lists)."""
    from verl.utils.reward_score import gsm8k

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(gsm8k.compute_score(t, g)) for t, g in zip(texts, ground_truth, strict=True)]


class TrlPhases:
    """Seconds per optimizer step in the wrapped methods of a `GRPOTrainer` instance, and
    the step's prompt and completion lengths."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.steps: list[dict[str, float]] = []
        self.lengths: list[dict[str, list[int]]] = []
        self.current: dict[str, float] = defaultdict(float)
        self.start = 0.0
        self.scoring = False  # inside `_generate_and_score_completions`
        self._wrap("_generate", self._timed("generation", self._note_lengths))
        self._wrap("_calculate_rewards", self._timed("scoring"))
        self._wrap("_generate_and_score_completions", self._timed("generate_and_score"))
        self._wrap("_get_per_token_logps_and_entropies", self._log_probs)

    def _wrap(self, name: str, wrapper) -> None:
        setattr(self.trainer, name, wrapper(getattr(self.trainer, name)))

    def _timed(self, phase: str, after=None):
        def wrapper(fn):
            def timed(*a, **k):
                start, outer = time.perf_counter(), self.scoring
                self.scoring = outer or phase == "generate_and_score"
                try:
                    out = fn(*a, **k)
                finally:
                    self.current[phase] += time.perf_counter() - start
                    self.scoring = outer
                if after is not None:
                    after(out)
                return out

            return timed

        return wrapper

    def _log_probs(self, fn):
        def timed(model, *a, **k):
            start = time.perf_counter()
            out = fn(model, *a, **k)
            if self.scoring:
                ref = model is self.trainer.ref_model
                self.current["ref_log_prob" if ref else "old_log_prob"] += (
                    time.perf_counter() - start
                )
            return out

        return timed

    def _note_lengths(self, out) -> None:
        prompt_ids, completion_ids = out[0], out[1]
        self.lengths.append(
            {"prompt": [len(p) for p in prompt_ids], "completion": [len(c) for c in completion_ids]}
        )

    def begin(self) -> None:
        self.current, self.start = defaultdict(float), time.perf_counter()

    def end(self) -> None:
        self.current["step"] = time.perf_counter() - self.start
        self.current["update"] = self.current["step"] - self.current["generate_and_score"]
        self.steps.append(dict(self.current))


def step_callback(phases: TrlPhases):
    """A `TrainerCallback` that opens and closes `phases`' optimizer steps."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            phases.begin()

        def on_step_end(self, args, state, control, **kwargs):
            phases.end()

    return StepClock()


def trl_config(args, out_dir: str):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=4,  # the example's micro-batch (sequences)
        gradient_accumulation_steps=8,  # one optimizer step = 32 completions = 8 prompts
        num_generations=N,
        num_iterations=1,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=1.0,
        beta=0.001,
        learning_rate=1e-6,
        lr_scheduler_type="constant",  # jaxrl's default schedule
        weight_decay=0.01,  # jaxrl's AdamW default (TRL's: 0)
        use_cpu=True,
        bf16=False,
        fp16=False,
        # transformers 5's name; TRL 1.16 still sets the deprecated `gradient_checkpointing`
        activation_checkpointing=args.gradient_checkpointing == "on",
        shuffle_dataset=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        max_steps=args.steps,
        disable_tqdm=True,
        seed=0,
    )


def bench_trl(args, rows: list[dict], shape: Shape, peak: float) -> dict:
    """TRL's `GRPOTrainer` on `rows` (8 prompts per step, in order)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=gsm8k_reward,
            args=trl_config(args, out_dir),
            train_dataset=Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(str(args.model)),
        )
        phases = TrlPhases(trainer)
        trainer.add_callback(step_callback(phases))
        trainer.train()
        checkpointing = bool(trainer.model.is_activation_checkpointing)  # set by `train()`
    lengths = [x["prompt"] for x in phases.lengths]
    completions = [c for x in phases.lengths for c in x["completion"]]
    flops = [phase_flops(shape, p, args.new_tokens) for p in lengths]
    report = phase_report(phases.steps[1:], flops[1:], peak)
    generation_bytes(report, shape, lengths[-1], args.new_tokens)
    report["generate_and_score"] = {
        "seconds": statistics.median(s["generate_and_score"] for s in phases.steps[1:])
    }
    steps = [s["step"] for s in phases.steps]
    return {
        "phases": report,
        "step_s_per_step": steps,
        "first_step_extra_s": steps[0] - median_after_first(steps),
        "activation_checkpointing": checkpointing,
        "completion_length_min": min(completions),
        "completion_length_max": max(completions),
        "prompt_tokens_per_step": [sum(p) for p in lengths],
    }


# ------------------------------------------------------------------------------------ main


def tiny_checkpoint(source: Path, folder: Path) -> Path:
    """A random 2-layer model with `source`'s tokenizer and its config shrunk (smoke runs)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    config = AutoConfig.from_pretrained(str(source))
    shrunk = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16)
    shrunk.update(num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True)
    for key, value in shrunk.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(folder))
    return folder


def targets(jaxrl: dict, trl: dict | None) -> dict:
    """The issue's targets: the update at >= 60% of the matmul peak, the step >= 2.5x TRL's."""
    update = jaxrl["phases"].get("update", {}).get("fraction_of_matmul_peak", 0.0)
    out = {"update_at_least_60pct_of_peak": update >= 0.6}
    if trl is not None:
        speedup = trl["phases"]["step"]["seconds"] / jaxrl["phases"]["step"]["seconds"]
        out["step_speedup_vs_trl"] = speedup
        out["step_at_least_2_5x_faster_than_trl"] = speedup >= 2.5
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("~/.cache/jaxrl/smollm2-135m-instruct"))
    parser.add_argument("--data", type=Path, default=Path("~/data/rg_gsm_symbolic"))
    parser.add_argument("--steps", type=int, default=3, help="steps; the first compiles")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens per response")
    parser.add_argument("--gradient-checkpointing", choices=("on", "off"), default="off")
    parser.add_argument("--no-trl", action="store_true", help="jaxrl only")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny random model with --model's tokenizer"
    )
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step compiles)")
    args.model, args.data = args.model.expanduser(), args.data.expanduser()
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tiny:
        if args.smoke:
            args.model = tiny_checkpoint(args.model, Path(tiny))
        shape = Shape.from_folder(args.model)
        peak = matmul_peak_flops()
        jaxrl, rows = bench_jaxrl(args, shape, peak)
        gc.collect()  # the jaxrl run's arrays, before TRL loads its models
        print("jaxrl", jaxrl, flush=True)
        trl = None if args.no_trl else bench_trl(args, rows, shape, peak)
        if trl is not None:
            print("trl", trl, flush=True)
    emit({"workload": "real-step", "model": str(args.model), "smoke": args.smoke,
          "prompts": len(rows) // args.steps, "n": N, "new_tokens": args.new_tokens,
          "steps": args.steps, "gradient_checkpointing": args.gradient_checkpointing,
          "matmul_params": shape.matmul_params, "peak_flops": peak, "jaxrl": jaxrl, "trl": trl,
          **targets(jaxrl, trl), "machine": machine()})  # fmt: skip


if __name__ == "__main__":
    main()
