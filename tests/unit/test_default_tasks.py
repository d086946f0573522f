"""The embedded task set's categories: the default's three as they were, multi-step tasks a search chain
answers where the world holds both facts and cannot where it lacks one."""

import re

import pytest

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.data.default_tasks import (
    CATEGORIES,
    MISSING_EVERY,
    MULTISTEP_RE,
    copy_tasks,
    generate_tasks,
    misstated_plan,
    plan_phrases,
    plan_text,
)
from tools_env.corpus import build_world
from tools_env.tools.search import BM25Index

_YEAR = re.compile(r"(?:founded|established) in (\d+)")


def test_the_default_categories_are_the_first_three_and_multistep_only_when_named():
    default = generate_tasks(40, 7)
    assert {t.category for t in default} == {"arithmetic", "lookup", "reasoning"}
    assert [t.to_json() for t in default] == [t.to_json() for t in generate_tasks(40, 7, "arithmetic,lookup,reasoning")]
    assert not any("search" in p for p in plan_phrases())
    assert any("multi-step" in p and "search by" in p for p in plan_phrases(CATEGORIES))
    four = generate_tasks(40, 7, CATEGORIES)
    assert [t.category for t in four[:4]] == list(CATEGORIES) and len({t.id for t in four}) == 40
    assert load_config(["data.categories=multistep,arithmetic"]).data.categories == "multistep,arithmetic"
    for bad, why in (("arithmetic,maths", "unknown"), ("lookup,lookup", "twice")):
        with pytest.raises(ConfigError, match=f"data.categories.*{why}"):
            load_config([f"data.categories={bad}"])


def test_a_multi_step_task_is_answered_by_the_years_its_entities_searches_find_unless_a_fact_is_missing():
    world = build_world(0)
    index = BM25Index(world.docs)
    tasks = generate_tasks(400, 3, "multistep")
    missing = 0
    for t in tasks:
        assert t.tools == ["search", "calculator", "expert", "answer"] and t.max_turns == 4
        early, late = MULTISTEP_RE.match(t.problem).groups()
        (doc_a, _), (doc_b, _) = index.search(early, 1)[0], index.search(late, 1)[0]
        found = int(_YEAR.search(doc_b.text).group(1)) - int(_YEAR.search(doc_a.text).group(1))
        assert doc_a.title == early and int(t.answer) > 0
        assert t.meta["search_queries"] == [early, late]  # what a simulated expert asked for a query writes
        if t.meta["searchable"]:
            assert doc_b.title == late and found == int(t.answer)
            assert t.meta["evidence"] == [f"[{doc_a.id}]", f"[{doc_b.id}]"]  # the documents the answer is in
        else:  # the world has no document of it: the chain finds another entity's year
            missing += 1
            assert late not in world.doc_id and doc_b.title != late and "evidence" not in t.meta
    assert missing == len(tasks) // MISSING_EVERY  # exactly every fifth
    held_out = [t for t in generate_tasks(96, 9, CATEGORIES) if t.category == "multistep"]
    assert sum(not t.meta["searchable"] for t in held_out) == 24 // MISSING_EVERY  # a held-out set's 24 hold 4


def test_the_task_set_is_the_same_however_often_it_is_drawn():
    """A name the world lacks is drawn apart from the world's words, which are computed once: drawing one must
    not add it to them, or the next draw of the same seed names other entities."""
    first = [t.to_json() for t in generate_tasks(200, 5, CATEGORIES)]
    assert [t.to_json() for t in generate_tasks(200, 5, CATEGORIES)] == first


def test_copy_lessons_leave_multi_step_tasks_out():
    """The chain copies nothing (experts write its queries and its answer): no lesson is a multi-step task,
    and the other categories' lessons are those of the default."""
    lessons = copy_tasks(90, 5, CATEGORIES)
    assert {t.category for t in lessons} == {"arithmetic", "lookup", "reasoning"} and len(lessons) == 90
    assert [t.to_json() for t in lessons] == [t.to_json() for t in copy_tasks(90, 5)]
    assert copy_tasks(10, 5, "multistep") == []


def test_multi_step_tasks_are_about_the_world_the_search_tool_is_configured_with():
    from nemo_orchestra.data.default_tasks import search_corpus_seed
    from tools_env.tools.search import SearchTool

    assert search_corpus_seed({}, "multistep") == 0
    assert search_corpus_seed({"tools": {"search": {"corpus_seed": 3}}}, CATEGORIES) == 3
    with pytest.raises(ValueError, match="built-in world, not the corpus"):
        search_corpus_seed({"tools": {"search": {"corpus": "docs.jsonl"}}}, CATEGORIES)
    assert search_corpus_seed({"tools": {"search": {"corpus": "docs.jsonl"}}}, "arithmetic") == 0  # no chains: unused
    tool = SearchTool({"corpus_seed": 3, "k_default": 1})
    for t in generate_tasks(60, 2, "multistep", corpus_seed=3):
        early, late = MULTISTEP_RE.match(t.problem).groups()
        (doc_a, _), (doc_b, _) = tool.index.search(early, 1)[0], tool.index.search(late, 1)[0]
        assert doc_a.title == early
        if t.meta["searchable"]:
            years = [int(_YEAR.search(d.text).group(1)) for d in (doc_a, doc_b)]
            assert years[1] - years[0] == int(t.answer)


def test_a_plan_is_read_for_the_kind_and_preference_it_restates():
    """Every plan the warm start writes states its own task right; one written for another kind or profile is
    misstated (the head it should have written comes back); free thinking, and tasks of no kind or profile, are
    not read."""
    from nemo_orchestra.prompting.preferences import PREFERENCES

    calls = [("answer", {"model": "expert-large"}), ("expert", {"model": "expert-small"}), ("calculator", {})]
    calls += [("search", {"model": "expert-medium"}), ("answer", {})]
    for category in CATEGORIES:
        for name in PREFERENCES:
            for tool, args in calls:
                for other_cat in CATEGORIES:
                    for other in PREFERENCES:
                        text = plan_text(other_cat, other, tool, args) + "<tool_call>"
                        want = None if (other_cat, other) == (category, name) else plan_text(category, name, "", {})
                        got = misstated_plan(category, name, text)
                        assert got == (want and want[len("<think>") : -len(": </think>\n")]), (category, name, text)
    assert misstated_plan("lookup", "cost_sensitive", "<think>\nThe user wants it cheap: ask.</think>") is None
    assert misstated_plan("lookup", None, plan_text("lookup", "cost_sensitive", "answer", {})) is None
    assert misstated_plan("tau2-airline", "cost_sensitive", plan_text("lookup", "accuracy_first", "answer", {})) is None
