"""`python -m jaxrl.doctor`: a run checked without training, each problem found before a run
would meet it (in process: `main` returns the exit status and prints the report)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxrl import doctor
from jaxrl.checkpoint import INCOMPLETE, SAVING, write_manifest
from jaxrl.config import load_config
from jaxrl.data import synthetic
from jaxrl.data.rows import write_parquet
from jaxrl.trainer.memory import bytes_per_device

ROOT = Path(__file__).parents[1]
CONFIG = str(ROOT / "configs" / "quickstart.yaml")


def quickstart(tmp_path: Path, *overrides: str) -> list[str]:
    """The quickstart's arguments with its assets and run directory inside `tmp_path`."""
    return [
        "--config",
        CONFIG,
        f"assets.dir={tmp_path}",
        f"actor_rollout_ref.model.path={tmp_path}/model",
        f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/test.parquet",
        f"trainer.default_local_dir={tmp_path}/run",
        *overrides,
    ]


def run(capsys, args: list[str]) -> tuple[int, str]:
    status = doctor.main(args)
    out = capsys.readouterr()
    return status, out.out + out.err


@pytest.mark.slow
def test_quickstart_is_healthy_and_its_memory_estimated(tmp_path, capsys):
    status, out = run(capsys, quickstart(tmp_path))
    assert status == 0, out
    for section in ("config", "models", "data", "checkpoints", "plan", "memory"):
        assert f"== {section}" in out
    assert "train: 1024 rows in 1 file(s)" in out
    assert "M parameters" in out and "active per token" not in out  # a dense actor
    assert "no checkpoints; the run starts at step 1" in out
    assert "steps: 200 (64 batches per epoch of 1024 rows" in out
    assert "per step: 16 prompts x n=16 = 256 responses" in out
    # on-policy (one mini-batch, one epoch): no old-log-prob pass
    for program in ("generate", "validate generate", "actor micro-batch", "actor optimizer"):
        assert f"\n   {program} " in out
    assert "actor log-probs" not in out
    assert "estimated peak per device:" in out and "no problems found" in out
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written to the run


def bad_data(tmp_path: Path) -> tuple[Path, Path]:
    """Quickstart rows with a malformed row (1) and a long prompt (2), and a file of gsm8k
    rows whose ground truths are ints, which the built-in scorer would never match."""
    rows = synthetic.make_records(8, task="repeat", length=4, seed=0, split="train")
    rows[1]["prompt"] = []
    rows[2]["prompt"] = [{"role": "user", "content": "repeat: " + "7 " * 40}]
    ints = synthetic.make_records(2, task="repeat", length=4, seed=0, split="train")
    for row in ints:
        row["data_source"] = "openai/gsm8k"
        row["reward_model"] = {"style": "rule", "ground_truth": 72}
    return (
        Path(write_parquet(rows, tmp_path / "bad.parquet")),
        Path(write_parquet(ints, tmp_path / "ints.parquet")),
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The quickstart's model folder (made once)."""
    folder = tmp_path_factory.mktemp("assets")
    doctor.prepare(load_config(CONFIG, quickstart(folder)[2:]))
    return folder / "model"


def own_data(tmp_path: Path, model: Path, *overrides: str) -> list[str]:
    """The quickstart with the model of `model` and data files of the test's own."""
    return quickstart(
        tmp_path,
        "assets.quickstart=false",
        f"actor_rollout_ref.model.path={model}",
        f"data.val_files={model.parent}/test.parquet",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        *overrides,
    )


def test_every_bad_row_named_before_a_run(tmp_path, model, capsys):
    path, ints = bad_data(tmp_path)
    args = own_data(tmp_path, model, f"data.train_files=[{path},{ints}]", "--no-compile")
    status, out = run(capsys, args)
    assert status == 1, out
    assert f"train: 1 malformed rows: {path}: row 1: column 'prompt'" in out
    assert "data.skip_bad_rows=true" in out
    assert "train: 1 prompts are longer than data.max_prompt_length=16" in out
    assert f"{path}: row 2 (" in out
    assert "train: 2 rows the built-in scorers cannot score" in out
    assert f"{ints}: row 0: data_source 'openai/gsm8k' needs reward_model.ground_truth" in out
    assert "not estimated" not in out and "skipped (--no-compile)" in out
    assert "3 problem(s) found" in out


def test_skipping_and_truncating_are_reported_not_refused(tmp_path, model, capsys):
    path, ints = bad_data(tmp_path)
    args = own_data(
        tmp_path,
        model,
        f"data.train_files=[{path},{ints}]",
        "data.skip_bad_rows=true",
        "data.truncation=left",
        "custom_reward_function.path=" + str(ROOT / "tests/faults/faulty_scorers.py"),
        "custom_reward_function.name=compute_score",
        "--no-compile",
    )
    status, out = run(capsys, args)
    assert "train: 1 malformed rows will be skipped" in out
    assert "train: 1 prompts will be cut to 16 tokens (left)" in out
    assert status == 0, out


def checkpoint_step(root: Path, step: int, payload: bytes) -> Path:
    folder = root / str(step)
    folder.mkdir(parents=True)
    (folder / "state").write_bytes(payload)
    write_manifest(folder)
    return folder


def test_checkpoints_verified_and_the_resume_step_named(tmp_path, capsys):
    ckpts = tmp_path / "run" / "checkpoints"
    checkpoint_step(ckpts, 1, b"a" * 64)
    broken = checkpoint_step(ckpts, 2, b"b" * 64)
    (broken / "state").write_bytes(b"c" * 64)
    (ckpts / "3").mkdir()  # killed before it committed
    status, out = run(capsys, quickstart(tmp_path, "--no-compile"))
    assert f"step 3: {INCOMPLETE}" in out
    assert "step 2: state differs from what was written (sha256 mismatch)" in out
    assert "step 1: intact" in out
    assert "a run resumes from step 1; steps [3, 2] are set aside or deleted first" in out
    assert status == 0, out
    assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2", "3"]  # read only


def test_no_intact_checkpoint_is_a_problem(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
    status, out = run(capsys, quickstart(tmp_path, "--no-compile"))
    assert status == 1 and "no intact checkpoint; a run refuses to start" in out


def test_a_killed_first_save_is_deleted_not_a_problem(tmp_path, capsys):
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "1").mkdir(parents=True)
    (ckpts / f"1{SAVING}").write_text("0\n")  # the save in flight when the run was killed
    status, out = run(capsys, quickstart(tmp_path, "--no-compile"))
    assert "steps [1] are saves killed before they committed: a run deletes them" in out
    assert status == 0, out


def test_rows_no_distillation_teacher_takes_are_a_data_problem(tmp_path, capsys):
    """Several teachers: the train rows' `distillation.teacher_key` field (here `ability`,
    `synthetic` on every quickstart row) must be some teacher's key."""
    model = tmp_path / "model"
    entries = [
        (name, k, v) for name in ("x", "y") for k, v in (("key", name), ("model_path", model))
    ]
    teachers = [f"+distillation.teacher_models.{name}.{k}={v}" for name, k, v in entries]
    args = quickstart(tmp_path, "distillation.enabled=true", "distillation.teacher_key=ability",
                      *teachers, "--no-compile")  # fmt: skip
    status, out = run(capsys, args)
    assert "data.train_files: 1024 rows cannot be routed to a distillation teacher" in out
    assert "its ability='synthetic' is the key of no teacher" in out and status == 1, out


def test_a_bad_config_exits_2_naming_the_key(tmp_path, capsys):
    status, out = run(capsys, quickstart(tmp_path, "data.train_batch_sise=8"))
    assert status == 2 and "unknown config key 'data.train_batch_sise'" in out


@pytest.mark.slow
def test_memory_estimate_follows_the_config(tmp_path):
    """The estimate comes from the compiled programs: an abstract trainer (nothing loaded)
    plans exactly what the loaded one does; sharding the parameters over 8 devices divides
    the resident state by 8 (up to padding); a larger micro-batch needs more temporaries; and
    with a token budget the widest micro-batch packs many short rows padded to a full one."""
    from jaxrl.trainer.fit import build_run

    base = quickstart(tmp_path, "critic.enable=true", "actor_rollout_ref.actor.use_kl_loss=true")
    base = base[1:]
    assert doctor.prepare(load_config(base[0], base[1:], num_devices=8))  # model and data

    def plan(*overrides, abstract=True):
        cfg = load_config(base[0], [*base[1:], *overrides], num_devices=8)
        trainer = build_run(cfg, abstract=abstract).trainer
        return trainer, trainer.memory_plan()

    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    trainer, sharded = plan("mesh.fsdp=8", f"{micro}=2")
    loaded_trainer, loaded = plan("mesh.fsdp=8", f"{micro}=2", abstract=False)
    assert sharded == loaded
    # the step's batch, its rows split over the 8 devices (fsdp): prompts and their mask
    # [N, P], responses, response and loss masks [N, R], group ids [N], and a float32 [N, R]
    # per field the step adds; in the adds of every pass and update, not of generation
    cfg, n, r = trainer.cfg, trainer.sampling.n, trainer.sampling.max_tokens
    rows, p = cfg.data.train_batch_size * n, cfg.data.max_prompt_length
    fields = len(trainer.plan.held_fields)
    assert rows % 8 == 0
    assert sharded.batch == 4 * rows // 8 * (2 * p + 3 * r + 1 + fields * r) > 0
    values = sharded.programs["critic values"]  # its argument: the critic's parameters
    critic = bytes_per_device(trainer.cluster.critic.params)
    assert sharded.adds["critic values"] == values.beyond(critic) + sharded.batch
    assert sharded.adds["generate"] == sharded.programs["generate"].beyond(0)
    assert set(sharded.programs) == {
        "generate", "ref log-probs", "critic values", "critic micro-batch",
        "critic optimizer", "actor micro-batch", "actor optimizer",
    }  # fmt: skip
    assert bytes_per_device(loaded_trainer.cluster.actor.state) == sharded.resident["actor"]
    _, replicated = plan("mesh.fsdp=1", "mesh.dp=8", f"{micro}=2")
    assert replicated.resident["actor"] > 6 * sharded.resident["actor"]
    # The actor's micro-batch program is its own (the critic's are others): the plans that
    # only compare it leave the critic out, whose programs would compile for nothing.
    actor_only = ("mesh.fsdp=8", "critic.enable=false")
    _, larger = plan(*actor_only, f"{micro}=8")
    small = sharded.programs["actor micro-batch"].temporaries
    assert larger.programs["actor micro-batch"].temporaries > 2 * small
    assert larger.adds["actor micro-batch"] > sharded.adds["actor micro-batch"]
    # A budget of 32 valid tokens per device admits one full row (24 tokens: all-full rows
    # would make micro-batches of one row per device) but 16 short rows of 2: the planner
    # deals them into micro-batches of about 11 rows, padded to the full row's width.
    budget = ("actor_rollout_ref.actor.use_dynamic_bsz=true",
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32")  # fmt: skip
    _, dynamic = plan(*actor_only, *budget)
    _, one_row = plan(*actor_only, f"{micro}=1")
    widest = dynamic.programs["actor micro-batch"].temporaries
    assert widest > larger.programs["actor micro-batch"].temporaries  # eight rows
    assert widest > 4 * one_row.programs["actor micro-batch"].temporaries


def test_a_batch_larger_than_the_drawn_rows_is_a_problem(tmp_path, model, capsys):
    args = own_data(
        tmp_path,
        model,
        f"data.train_files={model.parent}/train.parquet",
        "data.train_max_samples=2",
        "--no-compile",
    )
    status, out = run(capsys, args)
    assert status == 1, out
    assert "train: 2 rows drawn (train_max_samples)" in out
    assert "batch size 4 is larger than the dataset (2 rows after filtering)" in out


def test_resume_path_and_a_fresh_start_over_checkpoints_are_checked(tmp_path, capsys):
    ckpts = tmp_path / "run" / "checkpoints"
    checkpoint_step(ckpts, 1, b"a" * 64)
    status, out = run(capsys, quickstart(tmp_path, "trainer.resume_mode=disable", "--no-compile"))
    assert status == 1 and "already holds checkpoints of steps [1]" in out
    resume = ["trainer.resume_mode=resume_path", "--no-compile"]
    status, out = run(capsys, quickstart(tmp_path, f"trainer.resume_from_path={ckpts}/1", *resume))
    assert status == 0 and f"resumes from {ckpts}/1 (intact)" in out
    verl_style = tmp_path / "global_step_1"
    verl_style.mkdir()
    status, out = run(
        capsys, quickstart(tmp_path, f"trainer.resume_from_path={verl_style}", *resume)
    )
    assert status == 1 and "expected a step folder of a run's checkpoints" in out


def test_an_moe_actor_is_described_by_its_active_parameters_and_experts_per_device(tmp_path):
    import transformers

    folder = tmp_path / "moe"
    transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=12, num_experts=8,
        num_experts_per_tok=2,
    ).save_pretrained(folder)  # fmt: skip
    args = quickstart(tmp_path, f"actor_rollout_ref.model.path={folder}", "mesh.ep=2")
    line = doctor.model_line(load_config(CONFIG, args[2:], num_devices=8))
    assert line.startswith("actor: qwen3_moe, ")
    assert "active per token (2 of 8 experts); 4 experts per device (mesh.ep=2)" in line
