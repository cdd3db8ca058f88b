"""The `procs` fixture: worker subprocesses, killed at the end of the test if still running."""

import pytest
from _multiproc import Procs


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()
