"""Fixtures for the sandbox tests: its capabilities, workdirs, and the path (warm or cold) a test runs on.
(The fake OpenAI-compatible server, ``fake_openai``, is the root conftest's.)"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from sandbox_helpers import copy_package


HERE = os.path.dirname(os.path.abspath(__file__))


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


@pytest.fixture(scope="module")
def readable_package() -> str:
    """A copy of the package that `nobody` can import, in a fresh folder below /tmp (pytest's
    own tmp folders are 0700)."""
    parent = tempfile.mkdtemp(prefix="nemo-sandbox-package-")
    try:
        os.chmod(parent, 0o755)
        root = copy_package(parent)
        for dirpath, _, filenames in os.walk(root):
            os.chmod(dirpath, 0o755)
            for name in filenames:
                os.chmod(os.path.join(dirpath, name), 0o644)
        yield root
    finally:
        shutil.rmtree(parent, ignore_errors=True)
