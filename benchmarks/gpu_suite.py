"""One command that measures jaxrl on a CUDA GPU; `--dry-run` proves it on any CPU.

    bash benchmarks/gpu_suite.sh OUT_DIR [--wheels DIR]      # the GPU machine (installs, runs this)
    python benchmarks/gpu_suite.py OUT_DIR [--only a,b] [--dry-run]

Every step runs in a child process under its own time limit (so a hang, a crash or running out
of device memory costs one step, never the suite) and appends one JSON line per measurement to
OUT_DIR/results.jsonl; stdout ends with a summary table. The steps, with their limits (the
whole suite fits in 8 minutes on one H100):

    env          devices, jax, measured copy bandwidth and bf16 matmul rate, the bf16 peak  30 s
    tests        pytest: the `gpu` marker and the Pallas kernel tests, compiled for real     80 s
    attention    A1: Pallas and cuDNN, forward and forward+backward, 2k-32k tokens, bf16   60 s
    decode-M/L/1.5B  W1 in bf16: tokens/s and the fraction of the HBM-bandwidth roof    45 s each
    train-none/full  W2: the 1.5B shape at 4 x 2048 tokens, MFU, remat none / full      55 s each
    grpo-L       W3 for model L in bf16: generation, log-probs and update seconds          70 s

Each record carries the device's `peak_bytes_in_use` at the end of its measurement (GPUs report
it; each decode/train/grpo step is its own process, so the peak is that measurement's).

`--dry-run` runs every step on the CPU with tiny shapes (the Pallas kernels lowered for CUDA
without a GPU, the tests collected, not run), so CI proves the suite is not broken between GPU
runs. Figures of a dry run mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# bf16 dense tensor-core peak (FLOP/s) by device kind (substring, first match), from the
# vendors' data sheets: SXM parts (PCIe H100: 756e12).
BF16_PEAK = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("B200", 2250e12),
)

# The 1.5B shape: Qwen2.5-1.5B's (vocab 151936, tied embeddings).
QWEN_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    qkv_bias=True,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
    tie_word_embeddings=True,
)


def bf16_peak(kind: str) -> float | None:
    """The bf16 dense peak of a device kind (None: not in the table, e.g. a CPU)."""
    return next((peak for name, peak in BF16_PEAK if name in kind), None)


def peak_bytes() -> int | None:
    """`peak_bytes_in_use` of device 0 so far (None where the backend does not report it)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def device_facts() -> dict[str, Any]:
    import jax
    import jaxlib

    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "bf16_peak_flops": bf16_peak(device.device_kind),
    }


def copy_bandwidth(dry: bool) -> float:
    """HBM bytes/s of a device copy (bytes read + bytes written over the fastest of 7)."""
    import jax
    import jax.numpy as jnp
    from common import wall_seconds

    x = jnp.ones(((1 << 14) if dry else (1 << 30),), jnp.bfloat16)  # 2 GiB on a GPU
    copy = jax.jit(lambda x: x * 1)
    return 2 * x.nbytes / min(wall_seconds(lambda: copy(x).block_until_ready(), repeats=7))


def matmul_rate(dry: bool) -> float:
    """FLOP/s of an n^3 bf16 matmul (n = 8192; 256 in a dry run)."""
    import jax
    import jax.numpy as jnp
    from common import median_seconds

    n = 256 if dry else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(jnp.matmul)
    return 2 * n**3 / median_seconds(lambda: matmul(a, b).block_until_ready(), repeats=10)


# ------------------------------------------------------------------------------------ steps


def step_env(dry: bool) -> list[dict]:
    import jax

    jax.print_environment_info()
    return [
        {
            **device_facts(),
            "copy_bytes_per_s": copy_bandwidth(dry),
            "bf16_matmul_flops": matmul_rate(dry),
        }
    ]


def step_tests(dry: bool) -> list[dict]:
    """The `gpu` marker and the Pallas kernel tests (compiled on a GPU), in a pytest child."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu" if dry else "cuda"}
    args = ["-m", "gpu or not gpu", "tests/kernels/test_gpu.py", "tests/kernels/test_pallas_gpu.py"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    if dry:
        command.append("--collect-only")
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    print(out.stdout[-3000:], out.stderr[-2000:], sep="\n")
    summary = (out.stdout.strip().splitlines() or [""])[-1]
    return [{"returncode": out.returncode, "summary": summary}]


def step_attention(dry: bool) -> list[dict]:
    """A1 on the GPU: Pallas (best of two block shapes) and cuDNN, bf16."""
    import jax
    import jax.numpy as jnp
    from attention_gpu import cudnn_figures, pallas_figures, random_inputs

    peak = bf16_peak(jax.devices()[0].device_kind)
    records = []
    for t in (256,) if dry else (2048, 8192, 16384, 32768):
        q, k, v, dout = random_inputs(t)
        if dry:  # no GPU: the kernels lowered for CUDA, forward and backward
            from jaxrl.kernels.pallas_gpu import pallas_attention

            def loss(q, k, v):
                out, _ = pallas_attention(q, k, v, causal=True, scale=0.125)
                return jnp.sum(out.astype(jnp.float32))

            for fn in (loss, jax.grad(loss, (0, 1, 2))):
                jax.jit(fn).trace(q, k, v).lower(lowering_platforms=("cuda",))
            records.append({"t": t, "lowered_for_cuda": True})
            continue
        runs = [pallas_figures(q, k, v, dout, bq, bk) for bq, bk in ((64, 64), (128, 64))]
        outs = [run.pop("out") for run in runs]
        best = max(runs, key=lambda r: r["fwd_bwd_tflops"])
        cudnn = cudnn_figures(q, k, v, dout, pallas_out=outs[0])
        record = {"t": t, **best, **cudnn}
        if peak:
            record["pallas_fwd_bwd_of_peak"] = best["fwd_bwd_tflops"] * 1e12 / peak
        if "cudnn_fwd_bwd_tflops" in cudnn:
            record["pallas_of_cudnn_fwd_bwd"] = (
                best["fwd_bwd_tflops"] / cudnn["cudnn_fwd_bwd_tflops"]
            )
        records.append(record)
        print(record, flush=True)
    return records


def _decode(dry: bool, size: str) -> list[dict]:
    """W1 in bf16: 16 prompts x 64 tokens, 128 sampled tokens each."""
    import jax
    from generate import bench_engine

    import jaxrl.models as M

    bandwidth = copy_bandwidth(dry)
    if dry or size == "1.5B":
        shape = TINY if dry else QWEN_1_5B
        config = M.DecoderConfig(model_type="qwen2", param_dtype="bfloat16", **shape)
        params = jax.jit(lambda key: M.init_params(config, key))(jax.random.key(0))
    else:
        from common import workload_checkpoint

        config, params = M.from_pretrained(workload_checkpoint(size), dtype="bfloat16")
    figures = bench_engine(config, params, "bfloat16", bandwidth, new=8 if dry else 128)
    return [{"model": size, "bandwidth_bytes_per_s": bandwidth, **figures}]


def _train(dry: bool, remat: str) -> list[dict]:
    """W2 on the GPU: the 1.5B shape, 4 x 2048 tokens (tiny 2 x 64 dry), fp32 master weights,
    bf16 compute, AdamW; MFU = 6 * N * tokens / step / bf16 peak."""
    import jax
    from train_step import bench_train_step

    import jaxrl.models as M

    config = M.DecoderConfig(
        model_type="qwen2", param_dtype="float32", dtype="bfloat16", remat=remat,
        **(TINY if dry else QWEN_1_5B),
    )  # fmt: skip
    rows, length = (2, 64) if dry else (4, 2048)
    figures = bench_train_step(config, rows=rows, length=length, prompt=16 if dry else 64)
    peak = bf16_peak(jax.devices()[0].device_kind)
    if peak:
        figures["mfu"] = figures["flops"] / figures["step_s"] / peak
    return [{"model": "tiny" if dry else "1.5B", "remat": remat, **figures}]


def step_grpo(dry: bool) -> list[dict]:
    """W3 for model L in bf16, the update split in two mini-batches so that the step runs
    the old-log-prob pass too (a dry run: the quickstart's tiny model, 4 prompts, 8 tokens)."""
    from grpo_step import bench_jaxrl

    if dry:
        import tempfile

        from jaxrl.assets import write_quickstart_model

        folder = Path(tempfile.mkdtemp()) / "model"
        write_quickstart_model(folder)
        figures = bench_jaxrl(folder, None, dtype="bfloat16", prompts=4, new=8,
                              mini_batches=2, steps=2)  # fmt: skip
        return [{"model": "tiny", **figures}]
    from common import workload_checkpoint

    figures = bench_jaxrl(workload_checkpoint("L"), None, dtype="bfloat16", mini_batches=2)
    return [{"model": "L", "mini_batches": 2, **figures}]


STEPS: dict[str, tuple[int, Callable[[bool], list[dict]]]] = {  # name: (seconds, step)
    "env": (30, step_env),
    "tests": (80, step_tests),
    "attention": (60, step_attention),
    "decode-M": (45, lambda dry: _decode(dry, "M")),
    "decode-L": (45, lambda dry: _decode(dry, "L")),
    "decode-1.5B": (45, lambda dry: _decode(dry, "1.5B")),
    "train-none": (55, lambda dry: _train(dry, "none")),
    "train-full": (55, lambda dry: _train(dry, "full")),
    "grpo-L": (70, step_grpo),
}  # 485 s in all


# ------------------------------------------------------------------------------- the runner


def run_step(name: str, out_dir: Path, dry: bool) -> None:
    """In the child: run one step and append its records to results.jsonl."""
    start = time.perf_counter()
    records = STEPS[name][1](dry)
    peak = peak_bytes()
    with open(out_dir / "results.jsonl", "a") as f:
        for record in records:
            line = {"step": name, "dry_run": dry, "peak_bytes_in_use": peak, **record}
            line["seconds"] = time.perf_counter() - start
            f.write(json.dumps(line, sort_keys=True, default=str) + "\n")


def run_child(name: str, out_dir: Path, dry: bool, limit: int) -> dict[str, Any]:
    """One step in a child process under its time limit; what became of it."""
    command = [sys.executable, __file__, str(out_dir), "--step", name]
    command += ["--dry-run"] if dry else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry:  # one CPU device, whatever the caller's flags (a test session asks for 8)
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="")
    start = time.perf_counter()
    log = out_dir / f"{name}.log"
    with open(log, "w") as f:
        try:
            code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env,
                                  timeout=limit).returncode  # fmt: skip
            status = "ok" if code == 0 else f"failed (exit {code}, see {log.name})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit} s (see {log.name})"
    return {"step": name, "status": status, "seconds": round(time.perf_counter() - start, 1)}


def summary(out_dir: Path, outcomes: list[dict]) -> str:
    """A table of every step's outcome and its headline figures."""
    records: dict[str, list[dict]] = {}
    results = out_dir / "results.jsonl"
    if results.exists():
        for line in results.read_text().splitlines():
            r = json.loads(line)
            records.setdefault(r["step"], []).append(r)
    keys = (
        "tokens_per_s", "fraction_of_roofline", "mfu", "step_s", "generation_s",
        "log_prob_s", "update_s", "fwd_bwd_tflops", "pallas_of_cudnn_fwd_bwd",
        "copy_bytes_per_s", "bf16_matmul_flops", "summary",
    )  # fmt: skip
    lines = [f"{'step':<12} {'status':<34} {'s':>6}  figures"]
    for o in outcomes:
        for r in records.get(o["step"], [{}]):
            shown = {k: r[k] for k in keys if r.get(k) is not None}
            tag = r.get("t") or r.get("model") or ""
            if r.get("peak_bytes_in_use"):
                shown["peak_GiB"] = r["peak_bytes_in_use"] / 2**30
            figures = ", ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()
            )
            head = f"{o['step']:<12} {o['status'][:34]:<34} {o['seconds']:>6}"
            lines.append(f"{head}  {tag} {figures}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--only", help="comma-separated step names (default: all)")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # the child's entry
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(HERE), str(ROOT)]
    if args.step:
        run_step(args.step, args.out_dir, args.dry_run)
        return 0
    names = args.only.split(",") if args.only else list(STEPS)
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        parser.error(f"unknown steps {unknown}; choose from {', '.join(STEPS)}")
    outcomes = []
    for name in names:
        outcomes.append(run_child(name, args.out_dir, args.dry_run, STEPS[name][0]))
        print(f"{name}: {outcomes[-1]['status']} in {outcomes[-1]['seconds']} s", flush=True)
    table = summary(args.out_dir, outcomes)
    (args.out_dir / "summary.txt").write_text(table + "\n")
    print("\n" + table)
    return 0 if all(o["status"] == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
