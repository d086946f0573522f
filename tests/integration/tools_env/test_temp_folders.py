"""The tool service's folders go with it: a store nobody closed removes its episode root when it is
collected, and a service killed with SIGKILL (no clean-up of its own) leaves nothing once its
handle is stopped."""

import gc
import os
import signal

from tools_env.service_config import ServiceConfig
from tools_env.episodes import EpisodeStore
from tools_env.supervisor import start_service
from tools_env.prometheus import Metrics


def test_a_store_never_closed_removes_its_root_when_collected():
    store = EpisodeStore(ServiceConfig.from_dict({}), {}, Metrics())
    root = store.root
    assert os.path.isdir(root)
    del store
    gc.collect()
    assert not os.path.exists(root)


def test_a_killed_service_leaves_no_folder_after_stop():
    handle = start_service()
    assert handle.workdir and os.path.isdir(handle.workdir)
    roots = os.listdir(handle.workdir)
    assert len(roots) == 1 and roots[0].startswith("tools_env-w0-")  # the worker's episode root is under it
    os.killpg(handle.process.pid, signal.SIGKILL)
    handle.process.wait(10)
    assert os.path.isdir(os.path.join(handle.workdir, roots[0]))  # the worker could not clean up
    handle.stop()
    assert not os.path.exists(handle.workdir) and not os.path.exists(handle.tmpdir)


def test_a_given_workdir_root_is_the_users():
    with start_service({"workdir_root": None}) as plain:
        assert plain.workdir is not None
    import tempfile

    with tempfile.TemporaryDirectory() as mine:
        with start_service({"workdir_root": mine}) as handle:
            assert handle.workdir is None and os.listdir(mine)[0].startswith("tools_env-w0-")
        assert os.path.isdir(mine)
