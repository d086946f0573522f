"""The service keeps its published contract: ``/openapi.json`` is built from the schemas the handlers
validate with, and Schemathesis (every check) finds nothing against a live service, with and
without a token. Schemathesis runs as a subprocess on loopback with a bounded number of examples
and a wall-clock limit, so it stops by itself."""

import os
import shutil
import subprocess
import sys

import pytest

from tools_env.episodes import Episode
from tools_env.supervisor import start_service
from tools_env.openapi import openapi_document
from tools_env.schema import EPISODE_SUMMARY, STEP_REQUEST, check, task_record_schema
from tools_env.task import TaskRecord
from tools_env.verify import Outcome
from tools_env_helpers import http, qa_task

ST = shutil.which("st", path=os.path.dirname(sys.executable)) or shutil.which("st")


@pytest.mark.parametrize(
    "record, words",
    [
        ({**qa_task(["answer"]), "tools": []}, "field 'tools' must have at least 1 item"),
        (qa_task(["answer", "answer"]), "'tools' lists an item twice"),
        (qa_task(["answer"], prices={"x": 1}), "field 'prices.x' must be an object, got a number"),
        (qa_task(["answer"], prices={"x": {"input": True}}), "'prices.x.input' must be a number >= 0, got a boolean"),
        (qa_task(["answer"], prices={"x": {"in": 1}}), "'prices.x' has unknown field(s) 'in'"),
        (qa_task(["answer"], preference={"cost": -1}), "'preference.cost' must be a number >= 0"),
        (qa_task(["answer"], verifier={"type": ""}), "'verifier.type'"),
        (qa_task(["answer"], domain=3), "'domain' must be a string, got a number"),
        (qa_task(["answer"], max_turns=0), "field 'max_turns' must be an integer >= 1, got 0"),
        (qa_task(["answer"], max_turns=-2), "field 'max_turns' must be an integer >= 1, got -2"),
        (qa_task(["answer"], max_turns=2.5), "field 'max_turns' must be an integer >= 1, got a number"),
        (qa_task(["answer"], max_turns="20"), "field 'max_turns' must be an integer >= 1, got a string"),
        (qa_task(["answer"], max_turns=True), "field 'max_turns' must be an integer >= 1, got a boolean"),
        ({k: v for k, v in qa_task(["answer"]).items() if k != "answer"}, "task record is missing 'answer'"),
        (qa_task(["answer"], extra=1), "task record has unknown field(s) 'extra'"),
    ],
)
def test_the_task_schema_refuses_and_names_the_field(record, words):
    error = check(record, task_record_schema(), "task record")
    assert error is not None and words in error, error
    with pytest.raises(ValueError, match="task record"):
        TaskRecord.from_dict(record)


def test_an_integral_number_is_an_integer_as_json_schema_says():
    """``3.0`` is an integer by JSON Schema (what the published document promises and Schemathesis
    sends); the record holds the int, and a live service creates the episode (it refused it before)."""
    record = qa_task(["answer"], max_turns=3.0)
    assert check(record, task_record_schema(), "task record") is None
    task = TaskRecord.from_dict(record)
    assert task.max_turns == 3 and type(task.max_turns) is int
    assert TaskRecord.from_dict(qa_task(["answer"], max_turns=4)).max_turns == 4
    with start_service({}, workers=1) as svc:
        headers = {"Authorization": f"Bearer {svc.token}"} if svc.token else None
        status, body = http(f"{svc.urls[0]}/v1/episodes", "POST", record, headers=headers)
        assert status == 200 and body["episode_id"], body


def test_the_service_schema_lists_the_registered_verifier_types():
    """A task file may name a verifier type a plug-in registers; the service's own schema (and its
    /openapi.json) enumerates the types registered in it, and refuses the others at creation."""
    from tools_env.verify import VERIFIERS

    record = qa_task(["answer"], verifier={"type": "vibes"})
    assert TaskRecord.from_dict(record).verifier == {"type": "vibes"}
    error = check(record, task_record_schema(None, sorted(VERIFIERS)), "task record")
    assert {"db_state", "exact", "judge", "numeric"} <= set(VERIFIERS)  # bfcl too, with the 'bfcl' extra
    assert error is not None and f"'verifier.type' must be one of {', '.join(sorted(VERIFIERS))}" in error, error


def test_what_the_schema_accepts_the_record_accepts():
    full = qa_task(
        ["calculator", "answer"],
        id="t1",
        prices={"x": {"input": 0, "output": 2.5}},
        preference={"cost": 1, "tools": {"calculator": -1}},
        verifier={"type": "numeric", "rel_tol": 0.1},
        domain=None,
        gold_actions=[{"name": "f"}],
        max_turns=20,
        meta={"anything": [1, None]},
    )
    assert check(full, task_record_schema(["calculator", "answer"]), "task record") is None
    assert TaskRecord.from_dict(full).max_turns == 20
    assert TaskRecord.from_dict({**full, "max_turns": None}).max_turns is None  # null: the caller's limit
    assert TaskRecord.from_dict(qa_task(["answer"])).max_turns is None
    assert TaskRecord.from_dict(full).to_dict()["prices"] == {"x": {"input": 0, "output": 2.5}}
    assert check(TaskRecord.from_dict(full).to_dict(), task_record_schema(), "task record") is None  # round trip
    assert "must be one of answer" in check(full, task_record_schema(["answer"]), "task record")


def test_step_body_schema_admits_any_call_and_refuses_other_fields():
    for body in ({"name": 7}, {}, {"name": "x", "arguments": "[]"}, {"name": None, "arguments": None}):
        assert check(body, STEP_REQUEST, "step body") is None
    assert "unknown field(s) 'id'" in check({"name": "x", "id": 1}, STEP_REQUEST, "step body")


def test_summaries_of_every_state_fit_the_documented_schema():
    ep = Episode("e1", TaskRecord.from_dict(qa_task(["answer"])), None, {}, 0.0, 0.0)
    assert check(ep.summary(), EPISODE_SUMMARY, "summary") is None  # active: outcome and ended_by null
    ep.status, ep.ended_by, ep.outcome = "done", "max_turns", Outcome(False, 0.0, "guard")
    assert check(ep.summary(), EPISODE_SUMMARY, "summary") is None
    ep.status = "expired"
    assert check(ep.summary(), EPISODE_SUMMARY, "summary") is None


def test_security_is_declared_only_with_a_token():
    open_doc, locked = openapi_document(["answer"], auth=False), openapi_document(["answer"], auth=True)
    assert "security" not in open_doc and "securitySchemes" not in open_doc["components"]
    assert all("401" not in op["responses"] for ops in open_doc["paths"].values() for op in ops.values())
    assert locked["security"] == [{"bearer": []}]
    for path, ops in locked["paths"].items():
        for op in ops.values():
            public = path in ("/healthz", "/openapi.json")
            assert ("401" in op["responses"]) != public and (op.get("security") == []) == public, path
            assert "500" in op["responses"]


def test_405_lists_the_allowed_methods():
    with start_service() as svc:
        url = svc.urls[0]
        for path, method, allow in (
            ("/v1/episodes", "GET", "POST"),
            ("/healthz", "HEAD", "GET"),
            ("/v1/episodes/x", "PUT", "DELETE, GET"),
            ("/v1/episodes/x/step", "GET", "POST"),
        ):
            status, _, headers = _raw(f"{url}{path}", method)
            assert status == 405 and headers.get("Allow") == allow, (path, method, headers)


def _raw(url, method):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.mark.skipif(ST is None, reason="schemathesis is not installed (pip install -e '.[test]')")
@pytest.mark.timeout(400)
@pytest.mark.parametrize("token", [None, "s3cret"])
def test_schemathesis_finds_no_contract_break(token, tmp_path):
    with start_service(token=token) as svc:
        url = svc.urls[0]
        assert url.startswith("http://127.0.0.1:")
        assert http(f"{url}/openapi.json")[0] == 200  # readable without a token
        cmd = [
            ST,
            "--no-color",
            "run",
            f"{url}/openapi.json",
            "--checks",
            "all",
            "--max-examples",
            "20",
            "--seed",
            "7",
            "--workers",
            "1",
            "--request-timeout",
            "10",
        ]
        if token:
            cmd += ["-H", f"Authorization: Bearer {token}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "No issues found" in out, out[-6000:]
    assert "7 selected / 7 total" in out and "API Links:    3 covered" in out, out[-3000:]
