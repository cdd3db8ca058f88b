"""A user's `compute_score` from a file: called as verl calls it, picklable, and bad paths or
names are errors that name the path and the function."""

import pickle

import pytest

from jaxrl.config.schema import CustomRewardFunctionConfig
from jaxrl.rewards import (
    CustomRewardError,
    compute_score_from_config,
    default_compute_score,
    load_custom_reward_fn,
)


def test_calls_with_verl_keywords_and_reward_kwargs(scorers_file):
    fn = load_custom_reward_fn(str(scorers_file), "compute_score", {"bonus": 0.5})
    kw = dict(data_source="s", solution_str="a", ground_truth="a", extra_info={})
    assert fn(**kw) == 1.5
    assert fn(**kw, bonus=9.0) == 1.5  # configured reward_kwargs win, as in verl
    assert pickle.loads(pickle.dumps(fn))(**kw) == 1.5
    assert load_custom_reward_fn(f"file://{scorers_file}", "compute_score")(**kw) == 1.0


def test_from_config(scorers_file):
    assert compute_score_from_config(CustomRewardFunctionConfig()) is default_compute_score
    cfg = CustomRewardFunctionConfig(path=str(scorers_file), name="async_score")
    out = compute_score_from_config(cfg)(
        data_source="s", solution_str="a", ground_truth="a", extra_info={"index": 3}
    )
    assert out == {"score": 2.0, "index": 3}


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match=r"custom_reward_function.path=.*nope\.py"):
        load_custom_reward_fn(path, "compute_score")


def test_missing_function_names_the_function_and_path(scorers_file):
    with pytest.raises(AttributeError, match=r"name='score_it' is not defined in .*my_scorers"):
        load_custom_reward_fn(scorers_file, "score_it")
    with pytest.raises(CustomRewardError, match="not a function"):
        load_custom_reward_fn(scorers_file, "NOT_A_FUNCTION")
    with pytest.raises(CustomRewardError, match="name is empty"):
        load_custom_reward_fn(scorers_file, "")


def test_broken_file_names_the_path(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_module_anywhere\n")
    with pytest.raises(CustomRewardError, match=r"broken\.py.*ModuleNotFoundError"):
        load_custom_reward_fn(path, "compute_score")
