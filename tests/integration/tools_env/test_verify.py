"""Answer verification, hand-checked: normalization, numbers, delegation to domains and the judge."""

import pytest

from tools_env.task import TaskRecord
from tools_env.verify import (
    VERIFIERS,
    UnknownVerifierError,
    exact_match,
    extract_number,
    normalize_answer,
    numeric_match,
    parse_number,
    verify,
)

from tools_env_helpers import run


def task(answer, verifier=None, **kw):
    return TaskRecord.from_dict(
        {
            "problem": "q",
            "answer": answer,
            "category": "c",
            "tools": ["answer"],
            **({"verifier": verifier} if verifier else {}),
            **kw,
        }
    )


@pytest.mark.parametrize(
    "raw, want",
    [
        ("  The Eiffel   Tower! ", "eiffel tower"),
        ("an Apple a day", "apple day"),
        ("U.S.A.", "usa"),
        ("Theater", "theater"),  # "the" only as a whole word
        ("", ""),
    ],
)
def test_normalize_answer(raw, want):
    assert normalize_answer(raw) == want


def test_exact_match_ignores_case_punctuation_articles_and_whitespace():
    assert exact_match("the  eiffel tower.", "Eiffel Tower").correct
    assert not exact_match("Eiffel", "Eiffel Tower").correct
    assert exact_match("NYC", "New York City", aliases=["nyc"]).correct
    out = exact_match("Paris", "London")
    assert (out.correct, out.score) == (False, 0.0) and "'paris' != 'london'" in out.reason


@pytest.mark.parametrize(
    "raw, want",
    [
        ("1,234", 1234.0),
        ("3.0", 3.0),
        ("-2.5e3", -2500.0),
        ("3/4", 0.75),
        ("$12", 12.0),
        ("50%", 50.0),
        ("\\boxed{7}", 7.0),
        ("\\frac{1}{4}", 0.25),
        (".5", 0.5),
        ("+3", 3.0),
        ("1,234,567.5", 1234567.5),
        ("abc", None),
        ("1/0", None),
        ("1e400", None),
        ("-", None),
        ("1,2", None),
    ],
)
def test_parse_number(raw, want):
    assert parse_number(raw) == want


def test_extract_number_takes_the_last_number_when_the_whole_is_not_one():
    assert extract_number("x = 42") == 42.0
    assert extract_number("from 3 apples we get 1,234.5.") == 1234.5
    assert extract_number("no digits") is None


def test_numeric_match_tolerances():
    assert numeric_match("1,234", "1234").correct
    assert numeric_match("3.0", "3").correct
    assert numeric_match("1/3", "0.333333333", rel_tol=1e-6).correct
    assert not numeric_match("0.3333", "1/3", rel_tol=1e-6).correct
    assert numeric_match("0.3333", "1/3", rel_tol=1e-3).correct
    assert numeric_match("100.4", "100", abs_tol=0.5, rel_tol=0).correct
    assert not numeric_match("100.6", "100", abs_tol=0.5, rel_tol=0).correct
    assert "could not parse" in numeric_match("lots", "3").reason
    assert "not a number" in numeric_match("3", "three").reason


def test_verify_dispatches_on_verifier_type():
    assert run(verify("The answer is 1,000", task("1000", {"type": "numeric"}))).correct
    assert not run(verify("The answer is 1,000", task("1000"))).correct  # exact by default
    assert run(verify("999.5", task("1000", {"type": "numeric", "rel_tol": 1e-3}))).correct


class FakeJudge:
    def __init__(self, verdict):
        self.verdict, self.calls = verdict, 0

    async def grade(self, problem, gold, pred):
        self.calls += 1
        return self.verdict, "fake"


def test_judge_is_asked_only_when_exact_match_fails():
    judge = FakeJudge(True)
    assert run(verify("Eiffel Tower", task("eiffel tower", {"type": "judge"}), judge=judge)).correct
    assert judge.calls == 0
    out = run(verify("the tower in Paris", task("Eiffel Tower", {"type": "judge"}), judge=judge))
    assert out.correct and judge.calls == 1 and out.reason == "judge: fake"
    out = run(verify("the tower in Paris", task("Eiffel Tower", {"type": "judge"}), judge=None))
    assert not out.correct and "no judge endpoint" in out.reason


def test_db_state_is_registered_by_the_domains_package(monkeypatch):
    import tools_env.domains as domains

    seen = {}

    def verify_db_state(ctx, t):
        seen["args"] = (ctx, t.domain)
        return True, "tables match"

    monkeypatch.setattr(domains, "verify_db_state", verify_db_state)
    assert VERIFIERS["db_state"] is domains.db_state_verifier
    out = run(verify("done", task("", {"type": "db_state"}, domain="bank"), ctx="CTX"))
    assert (out.correct, out.reason) == (True, "db_state: tables match")
    assert seen["args"] == ("CTX", "bank")


def test_an_unregistered_verifier_type_is_an_error_naming_it(monkeypatch):
    """Not an incorrect outcome: a task nobody can verify is refused (the service does so at creation)."""
    with pytest.raises(UnknownVerifierError, match="verifier type 'regex' is not registered; registered types: "):
        run(verify("done", task("", {"type": "regex"})))
    import tools_env.domains  # noqa: F401

    monkeypatch.delitem(VERIFIERS, "db_state")
    with pytest.raises(UnknownVerifierError, match="registered by importing tools_env.domains"):
        run(verify("done", task("", {"type": "db_state"}, domain="bank")))


def test_a_verifier_that_raises_is_an_incorrect_outcome(monkeypatch):
    import tools_env.domains as domains

    def boom(ctx, t):
        raise KeyError("no such table")

    monkeypatch.setattr(domains, "verify_db_state", boom)
    out = run(verify("done", task("", {"type": "db_state"}, domain="bank")))
    assert not out.correct and "db_state verifier failed: KeyError" in out.reason
