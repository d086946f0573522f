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


def test_only_tritons_compiler_may_start_a_process_there():
    """Triton's JIT runs ptxas in a subprocess when a kernel compiles on CUDA: code that lies in Triton's
    package may start a process in the unit tier; the same call from anywhere else raises."""
    from tests.conftest import _TRITON_DIRS

    if not _TRITON_DIRS:
        pytest.skip("triton is not installed")
    source = "import subprocess, sys\nrc = subprocess.run([sys.executable, '-c', 'pass']).returncode"
    inside, outside = {}, {}
    exec(compile(source, _TRITON_DIRS[0] + "compiler_stand_in.py", "exec"), inside)
    assert inside["rc"] == 0
    with pytest.raises(RuntimeError, match="a unit test starts no process"):
        exec(compile(source, __file__, "exec"), outside)
