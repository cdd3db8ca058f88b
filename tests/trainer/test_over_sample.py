"""verl's `rollout.over_sample_rate` through the trainer: training rollouts stop early and the
aborted rows train on nothing; validation generates every row."""

import numpy as np
import pytest
from test_fit import config

from jaxrl.sharding.processes import to_host
from jaxrl.trainer.fit import fit
from jaxrl.trainer.loggers import read_metrics
from jaxrl.trainer.ppo_trainer import PPOTrainer


@pytest.mark.entry
def test_over_sampled_step_drops_the_slowest_rows(assets, tmp_path, monkeypatch):
    """rate 0.9: the step stops once int(16 x 0.1) = 1 of its 16 rows has finished (the
    quickstart's random policy ends a response before its 8 tokens), so the others come back
    empty: no loss tokens, no advantage, and verl's `response/aborted_ratio` counts them."""
    captured = []
    advantages = PPOTrainer._advantages

    def spy(self, batch, extra):
        out = advantages(self, batch, extra)
        captured.append((self.sampling, self.val_sampling, to_host(out[0].present())))
        return out

    monkeypatch.setattr(PPOTrainer, "_advantages", spy)
    run = tmp_path / "run"
    fit(config(assets, run, "actor_rollout_ref.rollout.over_sample_rate=0.9",
               "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # one mini-batch: some tokens
               "trainer.total_training_steps=1", "trainer.test_freq=1"))  # fmt: skip
    ((sampling, val_sampling, host),) = captured
    assert sampling.over_sample_rate == 0.9 and val_sampling.over_sample_rate == 0.0
    lengths = host["response_mask"].sum(-1)
    assert 1 <= (lengths > 0).sum() < 16
    aborted = lengths == 0
    assert (host["loss_mask"][aborted] == 0).all() and (host["advantages"][aborted] == 0).all()
    rows = read_metrics(run)
    train = next(r for r in rows if "response/aborted_ratio" in r)
    assert train["response/aborted_ratio"] == pytest.approx(aborted.mean())  # k / 16 in float32
    assert np.isfinite(train["actor/pg_loss"])
