"""The JAXRL_* variables: all three or none, each well-formed, with errors that say the fix."""

import subprocess
import sys

import pytest
from _multiproc import ROOT, clean_env

from jaxrl import distributed
from jaxrl.distributed import DistributedConfigError, explicit_spec

pytestmark = pytest.mark.multiprocess

GOOD = dict(JAXRL_COORDINATOR="10.0.0.1:8476", JAXRL_NUM_PROCESSES="2", JAXRL_PROCESS_ID="1")


def test_all_three_or_none():
    assert explicit_spec(GOOD) == ("10.0.0.1:8476", 2, 1)
    assert explicit_spec({}) is None
    assert explicit_spec({"JAXRL_PROCESS_ID": ""}) is None  # empty counts as unset
    assert explicit_spec({**GOOD, "JAXRL_COORDINATOR": "[::1]:8476"})[0] == "[::1]:8476"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(JAXRL_PROCESS_ID=None), "JAXRL_PROCESS_ID not set"),
        (dict(JAXRL_NUM_PROCESSES=None, JAXRL_PROCESS_ID=None), "JAXRL_NUM_PROCESSES and"),
        (dict(JAXRL_COORDINATOR="10.0.0.1"), "JAXRL_COORDINATOR='10.0.0.1' is not host:port"),
        (dict(JAXRL_COORDINATOR="host:99999"), "is not host:port"),
        (dict(JAXRL_NUM_PROCESSES="two"), "JAXRL_NUM_PROCESSES='two' is not a positive integer"),
        (dict(JAXRL_NUM_PROCESSES="0"), "JAXRL_NUM_PROCESSES='0' is not a positive integer"),
        (dict(JAXRL_PROCESS_ID="2"), "JAXRL_PROCESS_ID='2' is not an integer in [0, 2)"),
        (dict(JAXRL_PROCESS_ID="-1"), "JAXRL_PROCESS_ID='-1' is not an integer in [0, 2)"),
    ],
)
def test_bad_variables_name_the_variable_and_the_fix(change, expected):
    env = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(DistributedConfigError) as e:
        explicit_spec(env)
    assert expected in str(e.value)
    assert "set" in str(e.value) or "give" in str(e.value)  # and says what to do


def test_bad_timeouts_are_errors():
    with pytest.raises(DistributedConfigError, match="JAXRL_INIT_TIMEOUT='soon'"):
        distributed.initialize(environ={**GOOD, "JAXRL_INIT_TIMEOUT": "soon"})
    with pytest.raises(DistributedConfigError, match="must be > 0"):
        distributed.initialize(environ={**GOOD, "JAXRL_HEARTBEAT_TIMEOUT": "0"})


def test_train_cli_reports_partial_variables_before_touching_devices():
    out = subprocess.run(
        [sys.executable, "-m", "jaxrl.train", "--config", "configs/quickstart.yaml"],
        cwd=ROOT,
        env=clean_env(JAXRL_COORDINATOR="127.0.0.1:1234", JAXRL_NUM_PROCESSES="2"),
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert out.returncode == 2, out.stderr
    assert "error: JAXRL_PROCESS_ID not set" in out.stderr
    assert "JAXRL_PROCESS_ID=0..N-1" in out.stderr


def test_alone_initialize_does_nothing_and_leaves_the_backend_alone():
    code = (
        "from jaxrl import distributed; from jax._src import xla_bridge;"
        "info = distributed.initialize();"
        "print(info, distributed.is_main_process(), repr(distributed.process_log_prefix()),"
        " xla_bridge.backends_are_initialized())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert out.returncode == 0, out.stderr
    expected = "ProcessInfo(process_id=0, num_processes=1, coordinator=None) True '' False"
    assert out.stdout.strip() == expected
