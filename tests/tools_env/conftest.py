"""Fixtures for the tool-service tests: a fake OpenAI-compatible server subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def fake_openai():
    """Base URL (…/v1) of a fake OpenAI-compatible server subprocess."""
    tmp = tempfile.mkdtemp(prefix="fake-openai-")
    ready = os.path.join(tmp, "ready.json")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "fake_openai.py"), "--ready-file", ready],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"fake OpenAI server did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.02)
    with open(ready) as f:
        url = json.load(f)["url"]
    yield url + "/v1"
    proc.terminate()
    proc.wait(5)
