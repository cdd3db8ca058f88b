"""Step metrics against verl's own `metric_utils` on the same batch."""

import numpy as np
import pytest

from jaxrl.testing.reference import import_reference
from jaxrl.trainer.metrics import data_metrics, mfu_metrics, row_summaries, timing_metrics


def host_batch(n=6, p=5, r=7, seed=0):
    rng = np.random.RandomState(seed)
    p_len = rng.randint(1, p + 1, n)
    r_len = rng.randint(1, r + 1, n)
    r_len[2] = 0  # an aborted (empty) response
    r_len[3] = r  # a clipped one
    prompt_mask = (np.arange(p)[None] >= (p - p_len)[:, None]).astype(np.int64)
    response_mask = (np.arange(r)[None] < r_len[:, None]).astype(np.int64)
    scores = np.zeros((n, r), np.float32)
    scores[np.arange(n), np.maximum(r_len - 1, 0)] = rng.rand(n)
    return {
        "prompts": rng.randint(2, 50, (n, p)) * prompt_mask,
        "prompt_mask": prompt_mask,
        "responses": rng.randint(2, 50, (n, r)) * response_mask,
        "response_mask": response_mask,
        "token_level_scores": scores,
        "token_level_rewards": scores - 0.01 * rng.rand(n, r).astype(np.float32),
        "advantages": rng.randn(n, r).astype(np.float32),
        "returns": rng.randn(n, r).astype(np.float32),
        "values": rng.randn(n, r).astype(np.float32),
    }


def verl_batch(batch):
    import torch

    protocol = import_reference("verl.protocol")
    tensors = {k: torch.tensor(v) for k, v in batch.items() if k != "prompt_mask"}
    tensors["attention_mask"] = torch.tensor(
        np.concatenate([batch["prompt_mask"], batch["response_mask"]], axis=1)
    )
    tensors["response_mask"] = tensors["response_mask"].float()
    return protocol.DataProto.from_dict(tensors=tensors)


@pytest.mark.parametrize("use_critic", [False, True])
def test_data_metrics_equal_verl(use_critic):
    utils = import_reference("verl.trainer.ppo.metric_utils")
    batch = host_batch()
    widths = (batch["prompts"].shape[1], batch["responses"].shape[1])
    ours = data_metrics(row_summaries(batch, use_critic), widths, use_critic=use_critic)
    ref = utils.compute_data_metrics(verl_batch(batch), use_critic=use_critic)
    assert set(ours) == {k for k in ref if not k.startswith("num_turns")}
    for key, value in ref.items():
        # means, maxima and clip fractions of float32 batches, from float64 row sums here
        # and torch's float32 reductions: ~1e-7 relative (1e-6 absolute for means near 0)
        np.testing.assert_allclose(ours[key], float(value), rtol=1e-5, atol=1e-6, err_msg=key)


def test_metrics_of_rows_split_over_processes_equal_the_whole():
    """Each process summarises its own rows; the metrics of the gathered summaries are those
    of the whole batch, exactly (the same float64 per-row numbers, summed in the same order)."""
    batch = host_batch()
    parts = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    gathered = {k: np.concatenate([row_summaries(p, True)[k] for p in parts])
                for k in row_summaries(batch, True)}  # fmt: skip
    widths = (batch["prompts"].shape[1], batch["responses"].shape[1])
    whole = data_metrics(row_summaries(batch, True), widths, use_critic=True)
    assert data_metrics(gathered, widths, use_critic=True) == whole


def test_timing_metrics_equal_verl():
    utils = import_reference("verl.trainer.ppo.metric_utils")
    batch = host_batch()
    timing = {"gen": 1.5, "ref": 0.25, "update_actor": 2.0, "step": 4.0}
    ref = utils.compute_timing_metrics(verl_batch(batch), timing)
    ours = timing_metrics(row_summaries(batch, False), timing)
    assert set(ours) == set(ref)
    for key, value in ref.items():
        # ratios of the same float64 figures: rounding only
        np.testing.assert_allclose(ours[key], value, rtol=1e-6, err_msg=key)


def test_mfu_needs_a_known_peak(monkeypatch):
    batch = host_batch()
    timing = {"update_actor": 2.0, "old_log_prob": 0.5}
    monkeypatch.delenv("JAXRL_PEAK_FLOPS", raising=False)
    summaries = row_summaries(batch, False)
    assert mfu_metrics(summaries, timing, params=1000, epochs=1, devices=8) == {}  # CPU: unknown
    monkeypatch.setenv("JAXRL_PEAK_FLOPS", "1e6")
    tokens = batch["prompt_mask"].sum() + batch["response_mask"].sum()
    out = mfu_metrics(summaries, timing, params=1000, epochs=2, devices=8)
    # float64 arithmetic on the same figures (approx: 1e-6 relative)
    assert out["perf/mfu/actor"] == pytest.approx(6 * 1000 * tokens * 2 / 2.0 / 8e6)
    assert out["perf/mfu/actor_infer"] == pytest.approx(2 * 1000 * tokens / 0.5 / 8e6)


@pytest.mark.parametrize("n", [1, 3])
def test_validation_metrics_equal_verl(n):
    """mean@n and std@n of every variable, and the val-core / val-aux split, as verl's
    `process_validation_metrics` + `_val_metrics_update` give them (best/worst are bootstrap
    estimates in verl, so only their names are compared)."""
    from jaxrl.trainer.validation import validation_metrics

    utils = import_reference("verl.trainer.ppo.metric_utils")
    rng = np.random.RandomState(n)
    prompts = 5
    sources = ["a"] * (3 * n) + ["b"] * (2 * n)
    groups = np.repeat(np.arange(prompts), n)
    infos = {"reward": rng.rand(prompts * n).tolist(), "acc": rng.randint(0, 2, prompts * n)}
    infos["acc"] = [float(x) for x in infos["acc"]]
    ours = validation_metrics(sources, groups, infos)
    ref = utils.process_validation_metrics(sources, [str(g) for g in groups], infos)
    for source, variables in ref.items():
        core = "acc" if "acc" in variables else "reward"
        for var, stats in variables.items():
            for stat, value in stats.items():
                if not stat.startswith(("mean@", "std@")):
                    continue
                section = "val-core" if var == core and stat.startswith("mean") else "val-aux"
                key = f"{section}/{source}/{var}/{stat}"
                # means and stds of the same float64 lists (numpy both): rounding only
                np.testing.assert_allclose(ours[key], value, rtol=1e-6, err_msg=key)
    if n > 1:  # verl's bootstrap names for N = n
        assert "val-core/a/acc/best@3/mean" in ours and "val-aux/a/acc/worst@3/mean" in ours


def test_rollout_probs_diff_equals_verls_debug_metrics():
    """The rollout-vs-actor metrics of the old-log-prob pass (`training/rollout_probs_diff_*`,
    the Pearson correlation) equal verl's `calculate_debug_metrics` on the same batch, and
    a batch without response tokens gives verl's `valid` 0 and NaNs."""
    import torch

    from jaxrl.trainer.metrics import rollout_probs_diff

    debug = import_reference("verl.utils.debug.metrics")
    batch = host_batch()
    rng = np.random.RandomState(1)
    old = -rng.rand(*batch["response_mask"].shape).astype(np.float32) * 3
    rollout = old + 0.05 * rng.randn(*old.shape).astype(np.float32)
    tensors = verl_batch(batch)
    tensors.batch["old_log_probs"] = torch.tensor(old)
    tensors.batch["rollout_log_probs"] = torch.tensor(rollout)
    ref = debug.calculate_debug_metrics(tensors)
    ours = rollout_probs_diff(old, rollout, batch["response_mask"])
    assert set(ours) == set(ref)
    for key, value in ref.items():
        # float32 reductions in two libraries over ~25 tokens: ~1e-7 relative
        np.testing.assert_allclose(float(ours[key]), float(value), rtol=1e-5, err_msg=key)
    empty = rollout_probs_diff(old, rollout, np.zeros_like(batch["response_mask"]))
    assert float(empty["training/rollout_probs_diff_valid"]) == 0
    assert np.isnan(float(empty["training/rollout_probs_diff_max"]))
