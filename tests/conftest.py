"""Without CUDA the Triton kernels run through Triton's interpreter. ``TRITON_INTERPRET`` must be set
before ``triton`` is first imported (its language functions are built for one mode at import), and
test modules of any folder may import it at collection: so it is set here, at the root, first.

Under pytest-xdist (``addopts`` in pyproject.toml) each worker, and the processes its tests start,
run torch on one thread: the workers share the machine's cores, and OpenMP threads oversubscribed
past them spin against each other.

The suite's temporary files go to a folder of its own (``TMPDIR``, set in the first pytest process,
inherited by the workers and every process a test starts), removed when the suite ends: torchrun,
vLLM and wandb leave folders in the temp folder (``torchelastic_*``, ``vllm_dist_*``, ``tmp*wandb-*``)
that would otherwise pile up in /tmp run after run. A ``TMPDIR`` already set is the parent."""

import _posixsubprocess
import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pool, and for child processes

import pytest  # noqa: E402

from tests.doubles import EXPERT_CHAT_SERVER  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

SUITE_TMP = None  # the suite's temp folder, made by the first pytest process (not an xdist worker)
if not os.environ.get("PYTEST_XDIST_WORKER"):
    SUITE_TMP = tempfile.mkdtemp(prefix="nemo-tests-")
    os.chmod(SUITE_TMP, 0o1777)  # as /tmp: the sandbox tests' unprivileged user reaches folders below it
    os.environ["TMPDIR"] = SUITE_TMP
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    atexit.register(shutil.rmtree, SUITE_TMP, ignore_errors=True)  # also after a usage error
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# ---- tiers: a unit test starts no process -----------------------------------------------------------
UNIT_TIER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit") + os.sep
_SPAWNERS = [
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (_posixsubprocess, "fork_exec"),  # multiprocessing's spawn and forkserver
    (subprocess, "_fork_exec"),  # subprocess.Popen (its own reference to _posixsubprocess.fork_exec)
]


# Triton's JIT compiler runs its own toolchain (ptxas) in a subprocess on CUDA: a unit test that reaches a
# compiled kernel starts that process through Triton, not through the project, and is allowed it.
_TRITON_SPEC = importlib.util.find_spec("triton")  # its location only: triton is not imported here
_TRITON_DIRS = tuple(os.path.join(d, "") for d in (_TRITON_SPEC.submodule_search_locations if _TRITON_SPEC else ()))


def _called_from_triton() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_TRITON_DIRS):
            return True
        frame = frame.f_back
    return False


def _refuse(name, original):
    def refuse(*args, **kwargs):
        if _called_from_triton():
            return original(*args, **kwargs)
        raise RuntimeError(
            f"a unit test starts no process ({name} was called): move the test to tests/integration (tests/README.md)"
        )

    return refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under ``tests/unit`` every way of starting a process raises, from the first fixture's set-up to
    the last one's teardown (module fixtures included: they are set up within a test's protocol)."""
    if not (str(item.path).startswith(UNIT_TIER) or os.environ.get("NEMO_TESTS_GUARD_ALL")):
        yield
        return
    saved = [(m, n, getattr(m, n)) for m, n in _SPAWNERS if hasattr(m, n)]
    for m, n, f in saved:
        setattr(m, n, _refuse(n, f))
    try:
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


# ---- doubles -------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def fake_openai():
    """Base URL (…/v1) of a fake OpenAI-compatible server subprocess."""
    tmp = tempfile.mkdtemp(prefix="fake-openai-")
    ready = os.path.join(tmp, "ready.json")
    proc = subprocess.Popen(
        [sys.executable, EXPERT_CHAT_SERVER, "--ready-file", ready],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 20
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"fake OpenAI server did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.02)
    with open(ready) as f:
        url = json.load(f)["url"]
    try:
        yield url + "/v1"
    finally:
        proc.terminate()
        proc.wait(5)
        shutil.rmtree(tmp, ignore_errors=True)
