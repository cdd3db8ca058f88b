"""`async_training.mode=fully_async` on 8 fake CPU devices (training on 4, the rollouter's
engine on 4), attacked from the host side: a run whose rollout hangs mid-run stops within
`rollout_timeout` with an error naming the rollouter, its checkpoints intact; the run resumed
from them trains every prompt the loader gave once (those trained before the checkpoint, those
after, and those still pending at the end are the loader's rows, none twice); no trained
token is past the staleness bound; a rollouter thread that raises is reported by name; it
composes with dynamic sampling (groups judged as they finish), LoRA (pushes move the adapters
only) and several routed distillation teachers."""

import threading
import time

import jax
import numpy as np
import pytest
from _quickstart import quickstart_config
from test_distill_fit import routed_data, teacher_rows, torch_log_probs, two_teachers, write_teacher

from jaxrl.checkpoint import Checkpoints, step_numbers
from jaxrl.trainer import rollouter as rollouter_module
from jaxrl.trainer.fit import build_run, fit, train_run
from jaxrl.trainer.loggers import read_metrics
from jaxrl.trainer.ppo_trainer import PPOTrainer
from jaxrl.trainer.prompt_feed import PromptFeed
from jaxrl.trainer.rollouter import Rollouter, RolloutError
from jaxrl.trainer.staleness import StalenessGate

STEPS, PER_STEP = 5, 4
COMMON = [
    f"data.train_batch_size={PER_STEP}",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={PER_STEP}",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.max_num_seqs=16",  # 4 groups at once
    "mesh.placement.rollout.devices=4",
    "async_training.mode=fully_async",
    "async_training.trigger_parameter_sync_step=1",
    "async_training.staleness_threshold=1.0",  # 2 steps of groups per version: some lag
    "algorithm.rollout_correction.rollout_is=token",
]
RUN = [
    f"trainer.total_training_steps={STEPS}",
    "trainer.save_freq=2",
    "trainer.logger=[]",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]


@pytest.mark.slow
def test_a_hung_rollout_stops_the_run_and_the_resumed_run_trains_each_prompt_once(
    assets, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    trained: dict[int, list[int]] = {}  # step -> the dataset rows it trained
    current = {"step": 0}
    hang = threading.Event()
    feed_trained, scheduler_step = PromptFeed.trained, rollouter_module.Scheduler.step

    def record(self, prompts):
        trained.setdefault(current["step"], []).extend(p.row for p in prompts)
        return feed_trained(self, prompts)

    def step_or_hang(self):
        while hang.is_set():  # a decode chunk that never returns (until the test ends)
            time.sleep(0.05)
        return scheduler_step(self)

    step = PPOTrainer.step

    def counted(self, prompts, global_step):
        current["step"] = global_step
        if global_step == 3 and not resumed:  # past the compiles (seconds on a busy host)
            self.ahead.timeout = 3.0  # async_training.rollout_timeout from here on
            hang.set()
        return step(self, prompts, global_step)

    monkeypatch.setattr(PromptFeed, "trained", record)
    monkeypatch.setattr(rollouter_module.Scheduler, "step", step_or_hang)
    monkeypatch.setattr(PPOTrainer, "step", counted)
    resumed = False
    cfg = quickstart_config(assets, run_dir, *COMMON, *RUN)
    run = build_run(cfg)
    began = time.monotonic()
    try:
        with pytest.raises(RolloutError, match="in 3 s"):  # waiting for a group, or to push
            train_run(cfg, run)
    finally:
        run.trainer.close()
        hang.clear()
        for thread in threading.enumerate():  # the rollouter left behind ends its chunk:
            if thread.name == "rollouter":  # nothing of this run runs under later tests
                thread.join(60)
                assert not thread.is_alive()
    assert time.monotonic() - began < 120
    saved = step_numbers(run_dir / "checkpoints")
    assert saved and max(saved) in (2, 4)  # the last intact one before the hang
    resumed_from = max(saved)
    assert not any(trained.get(s) for s in range(resumed_from + 2, STEPS + 1))

    before = {s: rows for s, rows in trained.items() if s <= resumed_from}
    trained.clear()
    resumed = True
    fit(quickstart_config(assets, run_dir, *COMMON, *RUN))  # resume_mode auto: from resumed_from
    after = {s: rows for s, rows in trained.items() if s > resumed_from}
    assert sorted(after) == list(range(resumed_from + 1, STEPS + 1))

    ckpts = Checkpoints(run_dir / "checkpoints")
    meta = ckpts.read_meta(STEPS)
    ckpts.close()
    order = run.train_loader.order(0)
    assert meta["data"]["epoch"] == 0
    drawn = order[: meta["data"]["position"] * PER_STEP].tolist()
    used = [r for rows in (*before.values(), *after.values()) for r in rows]
    pending = meta["async_feed"]["pending"]
    assert len(used) == len(set(used)) == STEPS * PER_STEP  # each trained once
    assert sorted(used + pending) == sorted(drawn)  # none lost, none twice

    metrics = read_metrics(run_dir)
    bound_versions = 2 * 1 + 1 - 1  # (bound x trigger + trigger - 1) x updates per step
    assert all(r["async/staleness/max"] <= bound_versions for r in metrics if "async/pushes" in r)
    assert any(r["async/staleness/max"] > 0 for r in metrics if "async/pushes" in r)
    assert all(np.isfinite(r["actor/pg_loss"]) for r in metrics if "actor/pg_loss" in r)


class _FailingScheduler:
    """A scheduler whose decode chunk raises (a broken engine)."""

    def __init__(self, engine, chunk):
        self.free_slots, self.busy = engine.slots, True

    def submit(self, *args, copies, **kwargs):
        self.free_slots -= copies
        return []

    def step(self):
        raise FloatingPointError("the decode step blew up")


class _Engine:
    slots = 8


class _Loader:
    class dataset:
        @staticmethod
        def batch(rows, **kwargs):
            raise AssertionError("not used")

    def __next__(self):
        from jaxrl.data.batch import PromptBatch, object_array

        ids = np.ones((2, 4), np.int32)
        return PromptBatch(
            input_ids=ids, attention_mask=ids, group_ids=np.arange(2, dtype=np.int32),
            uid=object_array(["a", "b"]), row_ids=np.arange(2), data_source=None,
            ground_truth=None, ability=None, extra_info=None, raw_prompt=None,
            is_padding=np.zeros(2, bool),
        )  # fmt: skip


def test_a_rollouter_that_raises_is_reported_by_name(monkeypatch):
    from jaxrl.rollout import SamplingParams

    monkeypatch.setattr(rollouter_module, "Scheduler", _FailingScheduler)
    sampling = SamplingParams(n=4, max_tokens=8)
    thread = Rollouter(_Engine(), PromptFeed(_Loader()), StalenessGate(2, 1, 0.0), sampling, 0,
                       partial=True)  # fmt: skip
    thread.start()
    with pytest.raises(RolloutError, match="FloatingPointError: the decode step blew up"):
        thread.get(timeout=30)
    thread.stop(timeout=5)


def test_dynamic_sampling_judges_groups_as_they_finish(assets, tmp_path, step_batches):
    """DAPO's dynamic sampling under fully_async: each finished group is scored and judged
    as it comes (`filter_groups.metric=seq_reward`); every group trained on has responses
    whose summed scores differ (the rule), scored once (the scores in the batch are the
    judge's), the evicted ones are counted and their prompts used up, and the checkpoint's
    accounting holds: the loader's rows drawn less the pending ones are the trained and the
    evicted groups' prompts."""
    steps = 3
    cfg = quickstart_config(
        assets, tmp_path / "run", *COMMON,
        f"trainer.total_training_steps={steps}", f"trainer.save_freq={steps}",
        "trainer.logger=[]", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward",
    )  # fmt: skip
    calls = []
    run = build_run(cfg)
    reward = run.trainer.producer.reward_fn
    run.trainer.producer.reward_fn = lambda *a: calls.append(len(a[1])) or reward(*a)
    try:
        train_run(cfg, run)
    finally:
        run.trainer.close()
    metrics = [r for r in read_metrics(tmp_path / "run") if "async/pushes" in r]
    assert [r["training/global_step"] for r in metrics] == list(range(1, steps + 1))
    evicted = sum(r["training/filter_groups/evicted_samples"] for r in metrics)
    assert evicted > 0  # most groups of the untrained policy score 0 alike
    assert len(step_batches) == steps
    for batch in step_batches:
        sums = batch["token_level_scores"].sum(-1).reshape(PER_STEP, -1)  # [groups, n]
        assert (sums.std(-1) > 0).all(), sums
    # the judge scored each group once (n rows a call), nothing scored again for the step
    assert set(calls) == {4} and len(calls) == steps * PER_STEP + evicted
    ckpts = Checkpoints(tmp_path / "run" / "checkpoints")
    meta = ckpts.read_meta(steps)
    ckpts.close()
    drawn = run.train_loader.order(0)[: meta["data"]["position"] * PER_STEP].tolist()
    pending = meta["async_feed"]["pending"]
    assert not set(pending) - set(drawn)
    assert len(drawn) - len(pending) == steps * PER_STEP + evicted


@pytest.mark.entry
def test_fully_async_with_lora_and_routed_teachers(assets, tmp_path, step_batches):
    """fully_async composes with LoRA and several teachers: each push after the first moves
    the adapters only (the rollout's base arrays are the same objects at the end as after the
    first push), and a group's teacher route travels with it through the rollouter: each
    trained row's teacher log-probs equal those of the HF torch teacher its prompt names."""
    first = write_teacher(tmp_path / "first", assets / "model", seed=1)
    second = write_teacher(tmp_path / "second", assets / "model", seed=2, layers=2)
    data = tmp_path / "train.parquet"
    routed_data(assets, data, ["a", "b"])
    steps = 3
    lora_ = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
             "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"]  # fmt: skip
    cfg = quickstart_config(
        assets, tmp_path / "run", *COMMON, *lora_,
        *two_teachers(first, second, f"data.train_files={data}"),
        f"trainer.total_training_steps={steps}", "trainer.save_freq=-1", "trainer.logger=[]",
    )  # fmt: skip
    run = build_run(cfg)
    cluster = run.trainer.cluster
    bases = []
    sync = cluster.sync_weights

    def remember_base():
        pushed = sync()
        bases.append(jax.tree.leaves(cluster.rollout.weights.base))
        return pushed

    cluster.sync_weights = remember_base
    try:
        train_run(cfg, run)
    finally:
        run.trainer.close()
    assert len(bases) >= steps  # the first weights and a push a step (trigger 1)
    assert bases[0] and all(a is b for a, b in zip(bases[0], bases[-1], strict=True))
    metrics = [r for r in read_metrics(tmp_path / "run") if "async/pushes" in r]
    assert [r["training/global_step"] for r in metrics] == list(range(1, steps + 1))
    assert all(np.isfinite(r["distillation/loss"]) for r in metrics)
    for folder, rows in teacher_rows(assets, step_batches[-1], first, second):
        # jaxrl's forward against torch's: DESIGN §6's composite tolerance
        want = torch_log_probs(folder, step_batches[-1])[rows]
        np.testing.assert_allclose(
            step_batches[-1]["teacher_log_probs"][rows], want, rtol=1e-4, atol=1e-4
        )
