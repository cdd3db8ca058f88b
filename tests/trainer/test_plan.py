"""The step plan reads what an estimator registered: a registered estimator that reads a
critic's values gets them from the critic's pass, and without a critic the run is refused
with the key that gives it one."""

import dataclasses
import types

import pytest

from jaxrl.config import load_config
from jaxrl.core_algos import EstimatorInputs, registry
from jaxrl.trainer.plan import StepPlan


@pytest.fixture
def value_estimator():
    name = "test_value_baseline"
    registry.register_adv_est(name, inputs=EstimatorInputs(values=True))(lambda **kw: None)
    yield name
    del registry.ADV_ESTIMATOR_REGISTRY[name], registry.ESTIMATOR_INPUTS[name]


def cluster(critic: bool):
    return types.SimpleNamespace(
        critic=object() if critic else None, ref=None, teachers={},
        device_group=lambda role: "train",
        specs={role: types.SimpleNamespace(offloads=False) for role in ("actor", "critic")},
    )  # fmt: skip


def test_an_estimator_reading_values_runs_the_values_pass_or_is_refused(value_estimator):
    cfg = load_config("configs/quickstart.yaml", [])
    algorithm = dataclasses.replace(cfg.algorithm, adv_estimator=value_estimator)
    cfg = dataclasses.replace(cfg, algorithm=algorithm)
    plan = StepPlan.of(cfg, cluster(critic=True), n=4)
    assert plan.runs("values") and plan.critic_fields == ("values", "returns")
    with pytest.raises(ValueError, match=r"critic\.enable=true"):
        StepPlan.of(cfg, cluster(critic=False), n=4)
