"""The `python` tool through the service: output, errors, per-episode files, timeouts, cost."""

import importlib.util
import os

import pytest

from tools_env.supervisor import start_service
from tools_env_helpers import http, qa_task

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tools_env.sandbox") is None, reason="tools_env.sandbox is not importable yet"
)


@pytest.fixture(scope="module")
def url():
    with start_service({"python": {"wall_time_s": 2.0, "cpu_time_s": 2.0}}) as svc:
        yield svc.urls[0]


def episode(url):
    status, body = http(f"{url}/v1/episodes", "POST", qa_task(["python", "answer"]))
    assert status == 200, body
    return body["episode_id"]


def py(url, eid, code):
    status, r = http(
        f"{url}/v1/episodes/{eid}/step", "POST", {"name": "python", "arguments": {"code": code}}, timeout=30
    )
    assert status == 200, r
    return r


def test_prints_and_costs_by_the_second(url):
    r = py(url, episode(url), "print(sum(range(1000)))")
    assert r["observation"] == "499500" and r["error"] is None
    assert r["latency_s"] > 0 and r["cost"] == pytest.approx(r["latency_s"] * 0.0000083)


def test_an_exception_is_an_observation_not_a_tool_error(url):
    r = py(url, episode(url), "raise ValueError('boom')")
    assert "ValueError: boom" in r["observation"] and "[exit code 1]" in r["observation"]
    assert r["error"] is None and not r["done"]


def test_files_persist_within_an_episode_and_not_across(url):
    a, b = episode(url), episode(url)
    assert py(url, a, "open('notes.txt', 'w').write('kept')")["error"] is None
    assert py(url, a, "print(open('notes.txt').read())")["observation"] == "kept"
    assert "FileNotFoundError" in py(url, b, "print(open('notes.txt').read())")["observation"]


def test_a_runaway_program_times_out(url):
    r = py(url, episode(url), "while True:\n    pass")
    assert r["error"] and "timed out" in r["error"] and "[timed out]" in r["observation"]
    assert r["latency_s"] < 10


def test_bad_arguments_are_observations(url):
    eid = episode(url)
    status, r = http(f"{url}/v1/episodes/{eid}/step", "POST", {"name": "python", "arguments": {"source": "1"}})
    assert status == 200 and "missing argument 'code'" in r["error"]


def descendants(pid: int) -> list[int]:
    parents = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    found, todo = [], [pid]
    while todo:
        kids = [p for p, parent in parents.items() if parent == todo[-1]]
        todo.pop()
        found += kids
        todo += kids
    return found


def zygotes_below(pid: int) -> int:
    count = 0
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                count += b"# The zygote, the warm path" in f.read()
        except OSError:
            continue
    return count


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_python_warm_chooses_the_sandbox_path(warm):
    with start_service({"python": {"warm": warm}}) as svc:
        url = svc.urls[0]
        assert py(url, episode(url), "print(6 * 7)")["observation"] == "42"
        assert zygotes_below(svc.process.pid) == (1 if warm else 0)
