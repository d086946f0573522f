"""Nothing a run starts outlives it (nemo_orchestra/runtime/reaper.py): a job killed by SIGKILL leaves
no process behind — forked and spawned multiprocessing children, the resource tracker, a
subprocess in a session of its own, a grandchild — and no temporary folder, within 10 s."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watcher reads /proc (Linux)")

# A job with the process zoo of a vLLM run: a spawn child with a grandchild (engine core -> worker),
# a fork child, shared memory (the resource tracker), a service in its own session, a temp folder.
JOB = textwrap.dedent("""
    import multiprocessing as mp, os, signal, subprocess, sys, tempfile, time
    from multiprocessing import shared_memory

    def worker():
        time.sleep(600)

    def engine_core():
        mp.get_context("spawn").Process(target=worker).start()
        time.sleep(600)

    if __name__ == "__main__":
        # a shell's background job starts with SIGINT ignored, and Python then leaves it so
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from nemo_orchestra.runtime.reaper import contain
        contain()
        shm = shared_memory.SharedMemory(create=True, size=4096)  # starts the resource tracker
        mp.get_context("spawn").Process(target=engine_core).start()
        mp.get_context("fork").Process(target=worker).start()
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        folder = tempfile.mkdtemp(prefix="tools_env-")
        open(os.path.join(folder, "x"), "w").write("x")
        time.sleep(2)
        try:
            print("ready", os.environ["NEMO_ORCHESTRA_RUN"], shm.name, flush=True)
            time.sleep(600)
        except KeyboardInterrupt:
            os._exit(0)  # exits at once, its children still running
""")


def _marked(token: str) -> list[int]:
    from nemo_orchestra.runtime.reaper import marked

    return marked(token)


@pytest.fixture
def base():
    """The jobs' TMPDIR: in /tmp, since pytest's folders are too deep for multiprocessing's socket paths."""
    folder = Path(tempfile.mkdtemp(prefix="rp-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _start(tmp_path, base, **popen):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(base)}
    env.pop("NEMO_ORCHESTRA_RUN", None)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, **popen)
    word, token, shm = proc.stdout.readline().split()
    assert word == "ready"
    return proc, token, shm


def _wait_empty(token: str, base: Path, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = _marked(token)
        folders = [p.name for p in base.iterdir() if not p.name.startswith("torchinductor_")]
        folders += [p.name for p in Path("/dev/shm").glob(f"nor-{token}-*")]  # the run's /dev/shm folder
        if not left and not folders:
            return
        time.sleep(0.1)
    raise AssertionError(f"left after {timeout}s: processes {left}, folders {folders}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_every_process_and_folder_of_a_killed_job_is_gone_within_10_s(tmp_path, base, sig):
    proc, token, shm = _start(tmp_path, base)
    assert token.startswith(f"{proc.pid}-")  # re-executed in place: same pid
    marked = _marked(token)
    assert len(marked) >= 5, marked  # the job, 2 spawn children, a fork child, the tracker, the service
    (run_tmp,) = list(base.iterdir())
    if os.access("/dev/shm", os.W_OK):
        assert len(list(Path("/dev/shm").glob(f"nor-{token}-*"))) == 1
    assert any(p.name.startswith("tools_env-") for p in run_tmp.iterdir())  # the job's temp folders are in it
    t0 = time.monotonic()
    proc.send_signal(sig)
    proc.wait()
    _wait_empty(token, base)
    assert time.monotonic() - t0 < 10
    assert not os.path.exists(f"/dev/shm/{shm}")  # the resource tracker cleaned up as it ended


def test_a_job_that_exits_leaving_children_running_leaves_nothing(tmp_path, base):
    proc, token, _ = _start(tmp_path, base)
    try:
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:  # a failed test leaves no job behind either (its watcher sweeps the rest)
            proc.kill()
    _wait_empty(token, base)
