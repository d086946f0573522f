"""The unit tier starts no process: every way of starting one raises there (``tests/conftest.py``)."""

import multiprocessing
import subprocess
import sys

import pytest


def _nothing():
    pass


def test_a_unit_test_cannot_start_a_subprocess():
    with pytest.raises(RuntimeError, match="a unit test starts no process"):
        subprocess.run([sys.executable, "-c", "pass"])


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_a_unit_test_cannot_start_a_multiprocessing_process(method):
    with pytest.raises(RuntimeError, match="a unit test starts no process"):
        multiprocessing.get_context(method).Process(target=_nothing).start()
