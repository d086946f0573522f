"""Expert models: simulated ones in-process, real OpenAI-compatible endpoints through the service
(a fake server subprocess on loopback: answers, retries, a hanging model, a dead port)."""

import random
import time

import pytest

from tools_env.service_config import ExpertsConfig, for_category
from tools_env.supervisor import start_service
from tools_env.task import TaskRecord
from tools_env.tools.base import EpisodeContext
from tools_env.tools.experts import Expert, wrong_answer
from tools_env.verify import normalize_answer, parse_number
from tools_env_helpers import http, qa_task, run


def ctx_for(category="lookup", answer="Paris", turn=1, **kw):
    task = TaskRecord.from_dict(qa_task(["expert"], answer=answer, category=category, **kw))
    return EpisodeContext("e", task, "/nonexistent", random.Random(0), turn=turn)


def test_simulated_accuracy_follows_the_configured_rate():
    tool = Expert({"seed": 3})
    hits = 0
    for i in range(400):
        r = run(tool.call({"model": "expert-small", "query": "capital of France?"}, ctx_for(tag=str(i))))
        hits += r.observation == "expert-small: The answer is Paris."
        assert r.meta["simulated"] and r.usage["completion_tokens"] == 40  # expert-small, lookup
    assert 0.74 * 400 <= hits <= 0.86 * 400  # accuracy 0.8; 4 sigma is about +-0.06


def test_unlisted_categories_use_default_and_the_draw_is_seeded():
    tool = Expert({"seed": 1})
    a = run(tool.call({"model": "expert-medium", "query": "q"}, ctx_for(category="poetry")))
    b = run(tool.call({"model": "expert-medium", "query": "q"}, ctx_for(category="poetry")))
    c = run(Expert({"seed": 2}).call({"model": "expert-medium", "query": "q"}, ctx_for(category="poetry")))
    assert a.observation == b.observation and a.usage["completion_tokens"] == 250  # the default entry
    assert 3.0 <= a.latency_s <= 4.0 and c.usage == a.usage


def test_wrong_answers_are_plausible_and_wrong():
    rng = random.Random(0)
    for gold in ("42", "1,234", "0", "3.75", "-7", "Paris", "yes", "the Pacific Ocean", "Nepel", "aa", "Mi"):
        for _ in range(20):
            w = wrong_answer(gold, rng)
            assert normalize_answer(w) != normalize_answer(gold)
            if parse_number(gold) is not None:
                assert parse_number(w) is not None and parse_number(w) != parse_number(gold)
            if gold in ("Paris", "Nepel"):  # a one-word name misses with its own letters
                assert sorted(w.lower()) == sorted(gold.lower()) and w[0].isupper()


def test_sleep_makes_simulated_latency_real():
    cfg = ExpertsConfig.from_dict(
        {
            "sleep": True,
            "sleep_scale": 0.01,
            "simulated": {"s": {"price_in": 1, "price_out": 1, "accuracy": 1.0, "latency_s": 5.0, "output_tokens": 10}},
        }
    )
    t0 = time.perf_counter()
    r = run(Expert({"experts": cfg}).call({"model": "s", "query": "q"}, ctx_for()))
    assert r.latency_s == 5.0 and 0.04 <= time.perf_counter() - t0 < 1.0


def test_schema_lists_aliases_marked_simulated():
    schema = Expert({}).schema(None)["function"]
    assert schema["parameters"]["properties"]["model"]["enum"] == ["expert-small", "expert-medium", "expert-large"]
    assert "| expert-small (simulated) | 0.2 | 0.2 | 1.5 |" in schema["description"]


# ---- real endpoints through the service -------------------------------------------------------


def endpoint(base_url, model, **kw):
    return {"base_url": base_url, "model": model, "price_in": 2.0, "price_out": 4.0, "backoff_s": 0.05, **kw}


@pytest.fixture(scope="module")
def svc(fake_openai):
    config = {
        "experts": {
            "endpoints": {
                "echo": endpoint(fake_openai, "echo", latency_hint_s=0.5),
                "nousage": endpoint(fake_openai, "nousage"),
                "flaky": endpoint(fake_openai, "flaky", max_retries=3),
                "hang": endpoint(fake_openai, "hang", timeout_s=1.0),
                "dead": endpoint("http://127.0.0.1:9/v1", "x", timeout_s=2.0, max_retries=2),
                "refuses": endpoint(fake_openai, "bad"),
            }
        },
        "judge": {"base_url": fake_openai, "model": "judge", "timeout_s": 5},
    }
    with start_service(config) as handle:
        yield handle


def ask(svc, alias, query="what is 6*7?", **task_kw):
    url = svc.urls[0]
    status, created = http(f"{url}/v1/episodes", "POST", qa_task(["expert", "answer"], **task_kw))
    assert status == 200, created
    eid = created["episode_id"]
    t0 = time.perf_counter()
    status, r = http(
        f"{url}/v1/episodes/{eid}/step", "POST", {"name": "expert", "arguments": {"model": alias, "query": query}}
    )
    assert status == 200, r
    return r, time.perf_counter() - t0, created


def test_endpoint_answer_cost_from_reported_usage(svc):
    r, _, created = ask(svc, "echo")
    assert r["observation"] == "echo: echo: what is 6*7?" and r["error"] is None
    assert r["cost"] == pytest.approx((11 * 2.0 + 7 * 4.0) / 1e6)
    assert "| echo | 2 | 4 | 0.5 |" in created["tools"][0]["function"]["description"]
    r, _, _ = ask(svc, "echo", prices={"echo": {"output": 0}})
    assert r["cost"] == pytest.approx(11 * 2.0 / 1e6)


def test_missing_usage_is_estimated(svc):
    r, _, _ = ask(svc, "nousage", query="x" * 40)
    assert r["error"] is None and r["cost"] == pytest.approx((10 * 2.0 + len("echo: " + "x" * 40) // 4 * 4.0) / 1e6)


def test_retries_with_backoff_until_success(svc, fake_openai):
    r, _, _ = ask(svc, "flaky")
    assert r["error"] is None and r["observation"].startswith("flaky: echo:")
    assert http(fake_openai.rsplit("/v1", 1)[0] + "/stats")[1]["flaky"] == 3  # two 503s, then the answer


def test_a_hanging_endpoint_costs_a_timeout_not_a_stuck_step(svc):
    r, elapsed, _ = ask(svc, "hang")
    assert r["error"] and "deadline" in r["observation"] and not r["done"] and r["cost"] == 0.0
    assert 0.9 <= r["latency_s"] and elapsed < 3.0


def test_a_dead_endpoint_is_an_error_observation(svc):
    r, elapsed, _ = ask(svc, "dead")
    assert r["error"] and "3 attempt(s)" in r["observation"] and elapsed < 3.0


def test_a_refusal_is_not_retried(svc, fake_openai):
    before = http(fake_openai.rsplit("/v1", 1)[0] + "/stats")[1].get("bad", 0)
    r, _, _ = ask(svc, "refuses")
    assert r["error"] and "HTTP 400" in r["observation"]
    assert http(fake_openai.rsplit("/v1", 1)[0] + "/stats")[1]["bad"] == before + 1


def test_llm_judge_verifier_through_the_service(svc):
    url = svc.urls[0]
    for pred, gold, want in (("forty two", "Forty Two", True), ("6 times 7", "42", False)):  # exact; judge
        _, created = http(
            f"{url}/v1/episodes", "POST", qa_task(["answer"], answer=gold, verifier={"type": "judge"}, tag=pred)
        )
        status, r = http(
            f"{url}/v1/episodes/{created['episode_id']}/step", "POST", {"name": "answer", "arguments": {"answer": pred}}
        )
        assert status == 200 and r["outcome"]["correct"] is want, r
    # exact match fails, the (fake) judge accepts: the gold answer occurs in the prediction
    _, created = http(
        f"{url}/v1/episodes", "POST", qa_task(["answer"], answer="42", verifier={"type": "judge"}, tag="j3")
    )
    r = http(
        f"{url}/v1/episodes/{created['episode_id']}/step",
        "POST",
        {"name": "answer", "arguments": {"answer": "The answer: 42"}},
    )[1]
    assert r["outcome"] == {"correct": True, "score": 1.0, "reason": "judge: judge says CORRECT"}


# ---- `answer` written by an expert (ToolOrchestra's answer with a model argument) -----------------


def _sim(accuracy):
    return {"price_in": 1.0, "price_out": 2.0, "accuracy": accuracy, "latency_s": 3.0, "output_tokens": 10}


@pytest.fixture(scope="module")
def writers():
    with start_service({"experts": {"simulated": {"never": _sim(0.0), "always": _sim(1.0)}}}) as handle:
        yield handle.urls[0]


def _episode(url, **task_kw):
    status, created = http(f"{url}/v1/episodes", "POST", qa_task(["calculator", "expert", "answer"], **task_kw))
    assert status == 200, created
    return created["episode_id"], created["tools"]


def _step(url, eid, name, arguments):
    status, r = http(f"{url}/v1/episodes/{eid}/step", "POST", {"name": name, "arguments": arguments})
    assert status == 200, r
    return r


def test_answer_schema_offers_either_an_answer_or_a_writing_expert(writers):
    _, tools = _episode(writers)
    params = next(t for t in tools if t["function"]["name"] == "answer")["function"]["parameters"]
    assert set(params["properties"]) == {"answer", "model"} and params["properties"]["model"]["enum"] == [
        "never",
        "always",
    ]
    for bad in ({}, {"answer": "42", "model": "always"}, {"model": "gpt-9"}):
        eid, _ = _episode(writers)
        r = _step(writers, eid, "answer", bad)
        assert r["error"] and not r["done"], bad  # an error observation; the episode goes on
        assert _step(writers, eid, "answer", {"answer": "42"})["outcome"]["correct"]


def test_a_writing_expert_is_billed_and_graded(writers):
    eid, _ = _episode(writers)
    r = _step(writers, eid, "answer", {"model": "always"})
    assert r["done"] and r["outcome"]["correct"] and "always wrote: 42" in r["observation"]
    assert r["cost"] > 0 and r["latency_s"] == 3.0
    status = http(f"{writers}/v1/episodes/{eid}")[1]
    assert status["model_counts"] == {"always": 1} and status["total_cost"] == pytest.approx(r["cost"])
    eid, _ = _episode(writers)
    r = _step(writers, eid, "answer", {"model": "never"})
    assert r["done"] and not r["outcome"]["correct"] and r["cost"] > 0


def test_a_simulated_writer_uses_evidence_from_earlier_tool_results(writers):
    eid, _ = _episode(writers)  # the weakest writer, with the right number from the calculator in front of it
    assert _step(writers, eid, "calculator", {"expression": "6 * 7"})["observation"] == "42"
    assert _step(writers, eid, "answer", {"model": "never"})["outcome"]["correct"]
    eid, _ = _episode(writers)  # a wrong number is no evidence
    _step(writers, eid, "calculator", {"expression": "6 * 8"})
    assert not _step(writers, eid, "answer", {"model": "never"})["outcome"]["correct"]
    status, created = http(f"{writers}/v1/episodes", "POST", qa_task(["python", "answer"]))
    eid = created["episode_id"]  # code that prints every candidate states the gold without knowing it
    assert " 42 " in _step(writers, eid, "python", {"code": "print(*range(100))"})["observation"]
    assert not _step(writers, eid, "answer", {"model": "never"})["outcome"]["correct"]


def test_a_simulated_writer_copies_nothing_an_endpoint_expert_repeats(fake_openai):
    """In a service with endpoint and simulated experts, an endpoint's answer follows the query the policy wrote:
    asked to repeat the gold, it states it, and a simulated writer does not copy it; a simulated expert's answer
    stating the gold is copied."""
    experts = {
        "simulated": {"never": _sim(0.0), "always": _sim(1.0)},
        "endpoints": {"echo": endpoint(fake_openai, "echo")},
    }
    with start_service({"experts": experts}) as handle:
        url = handle.urls[0]
        eid, _ = _episode(url)
        assert "42" in _step(url, eid, "expert", {"model": "echo", "query": "say 42"})["observation"]
        assert not _step(url, eid, "answer", {"model": "never"})["outcome"]["correct"]
        eid, _ = _episode(url)
        assert _step(url, eid, "expert", {"model": "always", "query": "what is 6 * 7?"})["observation"].endswith("42.")
        assert _step(url, eid, "answer", {"model": "never"})["outcome"]["correct"]


def test_a_simulated_writer_has_the_evidence_when_the_results_hold_every_fact_the_task_names(writers):
    """``meta.evidence``: the strings the answer follows from (a multi-step question's documents); with all of
    them among the tool results the weakest writer answers right, with one missing it draws as usual."""
    from tools_env.corpus import build_world

    world = build_world(0)
    city, company = next(iter(world.cities)), next(iter(world.companies))
    evidence = [f"[{world.doc_id[city]}]", f"[{world.doc_id[company]}]"]

    def episode(meta):
        status, created = http(f"{writers}/v1/episodes", "POST", qa_task(["search", "answer"], meta=meta))
        assert status == 200, created
        return created["episode_id"]

    eid = episode({"evidence": evidence})
    _step(writers, eid, "search", {"query": city})
    _step(writers, eid, "search", {"query": company})
    assert _step(writers, eid, "answer", {"model": "never"})["outcome"]["correct"]
    eid = episode({"evidence": evidence})
    _step(writers, eid, "search", {"query": city})
    assert not _step(writers, eid, "answer", {"model": "never"})["outcome"]["correct"]
    status, r = http(
        f"{writers}/v1/episodes", "POST", qa_task(["search", "python", "answer"], meta={"evidence": evidence})
    )
    eid = r["episode_id"]  # the policy's code printing the second document's id is not that document
    _step(writers, eid, "search", {"query": city})
    assert evidence[1] in _step(writers, eid, "python", {"code": f"print({evidence[1]!r})"})["observation"]
    assert not _step(writers, eid, "answer", {"model": "never"})["outcome"]["correct"]
    eid = episode({"evidence": []})  # no facts named: no evidence
    _step(writers, eid, "search", {"query": city})
    assert not _step(writers, eid, "answer", {"model": "never"})["outcome"]["correct"]


def test_a_writer_with_the_documents_answers_at_its_evidence_accuracy():
    """With the documents found, a simulated writer answers at its ``evidence_accuracy`` (a difference of two
    years still slips a small model); a tool result that states the answer is copied, always right; the
    default experts' odds with the documents follow their size."""
    cfg = ExpertsConfig.from_dict(
        {
            "simulated": {
                "w": {
                    **_sim({"multistep": 0.1, "default": 0.0}),
                    "evidence_accuracy": {"multistep": 0.6, "default": 1.0},
                }
            }
        }
    )
    tool = Expert({"seed": 5, "experts": cfg})
    facts = ["[d1]", "[d2]"]
    right = stated = 0
    for i in range(400):
        c = ctx_for(category="multistep", answer="31", tag=str(i), meta={"evidence": facts})
        c.state["stated"] = [("search", "[d1] Founded in 1950."), ("search", "[d2] Founded in 1981.")]
        right += run(tool.write_answer("w", c))[0] == "31"
        c.state["stated"] = [("calculator", "31")]
        stated += run(tool.write_answer("w", c))[0] == "31"
    assert 0.52 * 400 <= right <= 0.68 * 400 and stated == 400  # 0.6; 4 sigma is about +-0.05
    with pytest.raises(ValueError, match="evidence_accuracy.multistep"):
        ExpertsConfig.from_dict(
            {"simulated": {"w": {**_sim(0.5), "evidence_accuracy": {"multistep": 1.5, "default": 1}}}}
        )
    odds = {a: for_category(e.evidence_accuracy, "multistep") for a, e in ExpertsConfig().simulated.items()}
    assert odds["expert-small"] < odds["expert-medium"] < odds["expert-large"] == 1.0


def test_an_endpoint_writer_gets_the_task_and_the_transcript(svc):
    url = svc.urls[0]
    status, created = http(f"{url}/v1/episodes", "POST", qa_task(["expert", "answer"], answer="x"))
    eid = created["episode_id"]
    _step(url, eid, "expert", {"model": "echo", "query": "hint please"})
    r = _step(url, eid, "answer", {"model": "echo"})
    # the echo endpoint writes back its prompt: the task, the tool results, the instruction
    assert r["done"] and "Task: What is 6 * 7?" in r["observation"] and "echo: hint please" in r["observation"]
    assert r["observation"].endswith("Reply with the final answer only.).")
    assert r["cost"] == pytest.approx((11 * 2.0 + 7 * 4.0) / 1e6)
    status, r = http(f"{url}/v1/episodes", "POST", qa_task(["expert", "answer"]))
    r = _step(url, r["episode_id"], "answer", {"model": "dead"})
    assert r["error"] and not r["done"]  # a writer that fails leaves the episode open


def test_an_endpoint_writes_a_search_query_from_the_context(svc):
    """``search`` with ``model``: the endpoint gets the task and the tool results and its reply's first line
    is the query; the search and the writer are billed together."""
    url = svc.urls[0]
    status, created = http(f"{url}/v1/episodes", "POST", qa_task(["search", "answer"]))
    eid = created["episode_id"]
    r = _step(url, eid, "search", {"model": "echo"})
    head = r["observation"].splitlines()[0]
    assert head == "echo searched for: echo: Task: What is 6 * 7? ()"  # the reply's first line (the echo: its prompt)
    assert r["cost"] > 0.01  # the search's $0.01 and the writer's tokens
    r = _step(url, eid, "search", {"model": "dead"})
    assert r["error"] and "dead" in r["observation"]  # a writer that fails searches nothing
    r = _step(url, eid, "search", {"model": "echo", "query": "x"})
    assert r["error"] and "either 'query'" in r["observation"]
