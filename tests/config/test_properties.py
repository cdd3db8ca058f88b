"""Property tests of the config loader: any override string either loads or raises a
`ConfigError` naming the key (or, when it does not parse, quoting the override)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl.config import ConfigError, load_config
from jaxrl.config.load import schema_index
from jaxrl.config.verl_compat import IGNORED, RENAMED

KEYS = sorted({*schema_index(), *RENAMED, *IGNORED})
KEY = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(KEYS).map(lambda k: k + ".x"),  # below a leaf, or inside a mapping
    st.from_regex(r"[a-z_]{3,8}(\.[a-z_0-9]{1,8}){0,3}", fullmatch=True),  # long: no accidental hit
)
VALUE = st.one_of(
    st.text(max_size=20),
    st.integers(-(10**12), 10**12).map(str),
    st.floats().map(repr),
    st.sampled_from(
        ["null", "true", "[]", "{}", "[1,2]", "{a: 1}", "'x'", '"', "[", "${data.seed}",
         "${nope}", "${oc.env:HOME}", "1e309", "-1", "0", "\\", "a,b", "~", "="]
    ),
)  # fmt: skip


def load(overrides: list[str]):
    return load_config("configs/quickstart.yaml", overrides, num_devices=8)


@given(KEY, VALUE)
def test_a_failing_override_names_its_key(key, value):
    text = f"{key}={value}"
    try:
        load([text])
    except ConfigError as e:
        assert key in str(e) or text in str(e), str(e)


@given(st.lists(st.one_of(st.text(max_size=40), st.builds("{}={}".format, KEY, VALUE)), max_size=3))
def test_any_override_strings_load_or_raise_config_error(texts):
    try:
        load(texts)
    except ConfigError as e:
        assert e.problems and all(isinstance(p, str) and p for p in e.problems)


@pytest.mark.parametrize(
    "override",
    [
        "mesh.rollout_rules.batch=7",
        "mesh.rollout_rules.batch=7.5",
        "mesh.rollout_rules.batch={a: b}",
    ],
)
def test_a_rule_that_is_not_an_axis_name_is_named(override):
    # Found by the properties above: a number here was a TypeError from the rule checks.
    with pytest.raises(ConfigError, match=r"mesh\.rollout_rules\.batch: "):
        load([override])


@pytest.mark.parametrize(
    "key", ["mesh.train_rules", "trainer.logger", "actor_rollout_ref.model.override_config"]
)
def test_an_interpolation_of_the_wrong_type_is_named(key):
    # Found by the properties above: `${data.seed}` (an int) resolved into a mapping or a list
    # was a TypeError later, or (override_config) silently 0.
    with pytest.raises(ConfigError, match=rf"{key}: 0 is not valid here; expected a"):
        load([f"{key}=${{data.seed}}"])
