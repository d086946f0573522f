"""The other entry points that start processes run contained too (nemo_orchestra/runtime/reaper.py): a benchmark or an
evaluation killed by SIGKILL leaves no tool service, no vLLM process and no temporary folder behind."""

import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.test_resume import (  # noqa: F401 (the fixture removes the launches' TMPDIR)
    ROOT,
    _assert_nothing_left,
    _children,
    _env,
    _remove_short_tmps,
    _short_tmp,
)


def _wait_for_tool_service(proc, log) -> list:
    """The launch's processes once its tool service is up."""
    deadline = time.monotonic() + 120
    while True:
        children = _children(proc)
        if any("tools_env.server" in " ".join(p.cmdline()) for p in children if p.is_running()):
            return children
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no tool service within 2 minutes"
        time.sleep(0.1)


def _tasks(path) -> str:
    from nemo_orchestra.data.default_tasks import generate_tasks

    path.write_text("".join(record.to_json() + "\n" for record in generate_tasks(8, seed=0)))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["benchmark", "evaluate"])
def test_sigkill_of_a_benchmark_or_an_evaluation_leaves_no_process_and_no_folder(entry, tmp_path):
    tmp, log = _short_tmp(tmp_path), tmp_path / "err.txt"
    if entry == "benchmark":  # long enough to be killed while its service serves calls
        args = ["recipes/benchmark.py", "tools_env", "--seconds", "60", "--out", str(tmp_path / "bench.json")]
    else:
        tasks = _tasks(tmp_path / "tasks.jsonl")
        args = ["recipes/evaluate.py", f"tasks={tasks}", f"output={tmp_path / 'eval'}", "policies=random", "samples=50"]
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / args[0]), *args[1:]],
            cwd=ROOT,
            env=_env(tmp),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        children = _wait_for_tool_service(proc, log)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    _assert_nothing_left(tmp, children)
