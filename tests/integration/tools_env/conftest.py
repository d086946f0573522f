"""Fixtures for the tool-service tests: a fake OpenAI-compatible server subprocess, and for the
sandbox tests: its capabilities, workdirs, and the path (warm or cold) a test runs on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from tests.doubles import EXPERT_CHAT_SERVER

HERE = os.path.dirname(os.path.abspath(__file__))


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


@pytest.fixture(params=[True, False], ids=["warm", "cold"])
def warm(request) -> bool:
    """The sandbox path: a child of the zygote (warm), or fresh interpreters (cold)."""
    return request.param


@pytest.fixture(scope="session")
def caps() -> dict[str, bool]:
    from tools_env.sandbox import sandbox_capabilities

    return sandbox_capabilities()


@pytest.fixture
def new_workdir(tmp_path, caps):
    """Makes workdirs below pytest's 0700 tmp_path, like the service's mkdtemp root; where there is no
    mount namespace to reach such a path from the dropped uid, below /tmp instead."""
    made = []

    def make() -> str:
        reachable = caps["mount_namespace"] or not caps["uid_drop"]
        made.append(tempfile.mkdtemp(prefix="work-", dir=tmp_path if reachable else None))
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def workdir(new_workdir) -> str:
    return new_workdir()
