"""Starting and stopping the service: auth, refusal to bind without a token, start-up failures,
several workers with client-side sharding, and idle expiry over HTTP."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from tools_env.client import ToolsEnvClient, ToolsEnvError
from tools_env.supervisor import REPO_ROOT, ServiceStartError, start_service
from tools_env_helpers import http, qa_task, run


def test_bearer_token_is_required_except_for_healthz_and_the_contract():
    with start_service(token="s3cret") as svc:
        url = svc.urls[0]
        assert http(f"{url}/healthz")[0] == 200
        status, spec = http(f"{url}/openapi.json")  # readable without the token, and says a token is needed
        assert status == 200 and spec["security"] == [{"bearer": []}]
        assert "401" in spec["paths"]["/v1/tools"]["get"]["responses"]
        for path, method in (
            ("/v1/tools", "GET"),
            ("/metrics", "GET"),
            ("/v1/episodes", "POST"),
            ("/v1/episodes/x", "GET"),
        ):
            status, body = http(f"{url}{path}", method, qa_task(["answer"]) if method == "POST" else None)
            assert status == 401 and body["error"]["code"] == "unauthorized", path
        status, body = http(f"{url}/v1/tools", headers={"Authorization": "Bearer wrong"})
        assert status == 401
        assert http(f"{url}/v1/tools", headers={"Authorization": "Bearer s3cret"})[0] == 200

        async def go():
            async with ToolsEnvClient(svc.urls, token="s3cret") as client:
                eid = (await client.create_episode(qa_task(["answer"])))["episode_id"]
                assert (await client.step(eid, "answer", {"answer": "42"}))["outcome"]["correct"]
            async with ToolsEnvClient(svc.urls) as anonymous:
                with pytest.raises(ToolsEnvError) as e:
                    await anonymous.create_episode(qa_task(["answer"]))
                assert (e.value.status, e.value.code) == (401, "unauthorized")

        run(go())


def test_refuses_a_public_address_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "TOOLS_ENV_TOKEN"}
    env["PYTHONPATH"] = REPO_ROOT
    p = subprocess.run(
        [sys.executable, "-m", "tools_env.server", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == 2 and "refusing to bind 0.0.0.0 without a bearer token" in p.stderr
    with pytest.raises(ServiceStartError, match="refusing to bind"):
        start_service(host="0.0.0.0", timeout_s=20)


def test_a_port_in_use_is_one_line_and_exit_code_2():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run(
            [sys.executable, "-m", "tools_env.server", "--port", str(port)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": REPO_ROOT},
            timeout=60,
        )
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "READY" not in p.stdout
    assert p.stderr.strip().splitlines() == [
        f"error: tools_env.server: port {port} is in use on 127.0.0.1 "
        "(choose another with --port, or --port 0 for a free one)"
    ]


def test_a_failed_start_raises_with_the_server_log():
    with pytest.raises(ServiceStartError, match="names unknown tool"):
        start_service({"tools": {"telepathy": {}}}, timeout_s=20)
    with pytest.raises(ValueError, match="guards.max_turn"):
        start_service({"guards": {"max_turn": 3}})


def test_workers_are_replicas_and_the_client_shards_by_episode_id():
    with start_service(workers=2) as svc:
        assert len(svc.urls) == 2 and len(set(svc.urls)) == 2

        async def go():
            async with ToolsEnvClient(svc.urls) as client:
                ids = [
                    (await client.create_episode(qa_task(["calculator", "answer"], tag=str(i))))["episode_id"]
                    for i in range(40)
                ]
                results = await asyncio.gather(*(client.step(i, "calculator", {"expression": "6*7"}) for i in ids))
                assert all(r["observation"] == "42" for r in results)
                return ids

        ids = run(go())
        counts = [http(f"{u}/healthz")[1]["episodes"] for u in svc.urls]
        assert sum(counts) == 40 and min(counts) > 0  # both workers hold some
        assert [http(f"{u}/healthz")[1]["worker"] for u in svc.urls] == [0, 1]
        # an episode made by worker 1 (server-side id) and asked of worker 0 says where it lives
        status, created = http(f"{svc.urls[1]}/v1/episodes", "POST", qa_task(["answer"]))
        assert created["episode_id"].startswith("w1-")
        status, body = http(f"{svc.urls[0]}/v1/episodes/{created['episode_id']}")
        assert status == 404 and "worker 1" in body["error"]["message"]
        pid = svc.process.pid
    with pytest.raises(ProcessLookupError):  # stop() took down the supervisor's whole group
        os.killpg(pid, 0)
    assert ids


def test_idle_episodes_expire_over_http():
    with start_service({"guards": {"ttl_s": 0.3, "gc_interval_s": 0.05}}) as svc:
        url = svc.urls[0]
        eid = http(f"{url}/v1/episodes", "POST", qa_task(["calculator", "answer"]))[1]["episode_id"]
        deadline = time.monotonic() + 10
        while http(f"{url}/v1/episodes/{eid}")[1]["status"] != "expired":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        status, body = http(f"{url}/v1/episodes/{eid}/step", "POST", {"name": "answer", "arguments": {"answer": "1"}})
        assert status == 410 and body["error"]["code"] == "episode_expired"
        assert "tools_env_episodes_expired_total 1" in http(f"{url}/metrics")[1]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_service_stops_when_its_launcher_is_killed(workers):
    """A launcher killed by SIGKILL runs no cleanup (an OOM kill, SLURM's final kill): the service
    it started notices it is orphaned and stops, workers and all, instead of running on, and removes
    the folders its launcher made for it."""
    code = (
        "import sys, time\n"
        "from tools_env.supervisor import start_service\n"
        f"svc = start_service(workers={workers})\n"
        "print(svc.process.pid, svc.tmpdir, svc.workdir, ' '.join(svc.urls), flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO_ROOT}
    )
    try:
        pid, tmpdir, workdir, *urls = launcher.stdout.readline().split()
        assert os.path.isdir(tmpdir) and len(os.listdir(workdir)) == workers  # a worker's episode root each
        assert len(urls) == workers and all(http(f"{u}/healthz")[0] == 200 for u in urls)
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(int(pid), 0)  # the service's process group: its supervisor and workers
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the service (process group {pid}) outlived its launcher by 15 s")
    for u in urls:
        with pytest.raises(OSError):
            http(f"{u}/healthz")
    assert not os.path.exists(tmpdir) and not os.path.exists(workdir)
