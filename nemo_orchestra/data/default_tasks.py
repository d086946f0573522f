"""The embedded default task set: small, generated locally, with a right tool per category.

Categories (the service's default simulated experts are tuned to them):

- ``arithmetic``: "What is 37 * 12?" — the free, exact ``calculator`` is the right tool (its
  result then answered, or handed to a cheap expert to write the answer); the cheap expert alone
  is unreliable.
- ``lookup``: facts about fictional places — the cheap expert mostly knows them (0.8), the strong
  one almost always (0.98).
- ``reasoning``: puzzles the strong (expensive) expert solves reliably (0.9), the medium one at
  0.6 and the cheap one rarely.
- ``multistep`` (FRAMES-shaped): "How many years after the founding of A was B founded?" about two
  entities of the search tool's world (``tools_env.corpus``). A chain of cheap calls answers it (two
  ``search`` calls whose queries an expert writes, then ``answer`` written by an expert from the two
  documents), unless the world has no document of B (every fifth task, ``MISSING_EVERY``): the search then
  finds another entity's year, as retrieval misses a fact, and the writer is left to its own skill. The
  strong expert answers at once (0.95), dear and slow; the others rarely. So the chain is preferred at low
  cost and the strong expert when accuracy comes first.

The final answer is the policy's own (``answer`` with ``answer``) or written by an expert
(``answer`` with ``model``), as in ToolOrchestra.

Each record carries its tool subset, per-alias prices perturbed around the paper's, and a
preference profile: cost-sensitive tasks weight cost and latency, accuracy-first tasks weigh
accuracy alone. Under the default simulated experts the best choices differ by profile: a
cost-sensitive lookup goes to the cheap expert and a cost-sensitive puzzle to the medium one,
while accuracy-first tasks go to the strong one; arithmetic goes to the calculator either way, and a
cost-sensitive multi-step task to the chain.
The policy reads the preference at the end of the user message (``prompting.prompts``).
"""

from __future__ import annotations

import functools
import random
import re
from typing import TYPE_CHECKING

from nemo_orchestra.config import EMBEDDED_CATEGORIES, parse_categories
from nemo_orchestra.prompting.preferences import PREFERENCES
from tools_env.task import TaskRecord

if TYPE_CHECKING:
    from nemo_orchestra.prompting.chat import ChatFormat
    from nemo_orchestra.types import Trajectory

CATEGORIES = EMBEDDED_CATEGORIES  # data.categories names a subset
DEFAULT_CATEGORIES = CATEGORIES[:3]  # the default recipe's
CHAIN = "multistep"  # the category a chain of cheap calls answers


def search_corpus_seed(service: dict, categories: str | tuple[str, ...]) -> int:
    """The ``corpus_seed`` of the search tool's world that ``service`` (``tools.service``) configures, which
    multi-step tasks are asked about; a search over a corpus file cannot serve them."""
    search = (service.get("tools") or {}).get("search") or {}
    if CHAIN in category_list(categories) and search.get("corpus"):
        raise ValueError(
            "data.categories: multistep asks about the search tool's built-in world, not the corpus "
            f"tools.service.tools.search.corpus={search['corpus']!r}; leave the corpus out or the category"
        )
    return int(search.get("corpus_seed", 0))


def category_list(categories: str | tuple[str, ...]) -> tuple[str, ...]:
    """``data.categories`` ("arithmetic,lookup") as a tuple; a tuple as it is."""
    return parse_categories(categories) if isinstance(categories, str) else tuple(categories)


EXPERT_PRICES = {  # $/1M tokens (input, output), after the paper's price table
    "expert-small": (0.2, 0.2),
    "expert-medium": (0.8, 0.8),
    "expert-large": (1.25, 10.0),
}


KINDS = {  # category -> word in the plan
    "arithmetic": "arithmetic",
    "lookup": "lookup",
    "reasoning": "puzzle",
    "multistep": "multi-step",
}
MULTISTEP_TOOLS = ["search", "calculator", "expert", "answer"]
MULTISTEP_TURNS = 4  # the chain takes 3 (two searches, the answer); one to spare
MISSING_EVERY = 5  # every fifth multi-step task names a later entity the search tool's world has no document of,
#   exactly (not a draw: twelve held-out tasks would hold 0 to 5): the cheap chain's ceiling (its writer's 0.9 with
#   the documents on four fifths, 0.1 on the rest) stays well under the strong expert's (0.95 alone, 0.99 after
#   the two searches)
CORPUS_SEED = 0  # the search tool's world (its ``corpus_seed``) the multi-step questions are about by default
MULTISTEP_RE = re.compile(r"How many years after the founding of (.+) was (.+) founded\?")
_SYL = ["ka", "lo", "mi", "ra", "te", "vo", "zu", "ne", "sha", "dri", "pel", "tor", "vin", "qua", "bel"]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYL) for _ in range(parts)).capitalize()


def _posed(a: int, b: int, rng: random.Random) -> tuple[str, str, dict]:
    """The question "What is a OP b?" with an operator drawn from ``rng``, its value and the numeric verifier."""
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", str(value), {"type": "numeric", "abs_tol": 1e-6}


def _arithmetic(rng: random.Random) -> tuple[str, str, dict]:
    return _posed(rng.randint(10, 99), rng.randint(2, 99), rng)


def _lookup(rng: random.Random) -> tuple[str, str, dict]:
    country, city = _name(rng, 2), _name(rng, 2)
    kind = rng.choice(["capital", "largest port", "oldest university town"])
    return f"What is the {kind} of {country}?", city, {"type": "exact"}


def _reasoning(rng: random.Random) -> tuple[str, str, dict]:
    n = rng.randint(3, 9)
    who = _name(rng, 2)
    answer = _name(rng, 1)
    return (
        f"{who} hides a word after {n} riddles; each riddle names the next. Which word is it?",
        answer,
        {"type": "exact"},
    )


@functools.lru_cache(maxsize=4)
def founding_years(
    corpus_seed: int = CORPUS_SEED,
) -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]], set[str]]:
    """The entities of the search tool's world whose founding year a ``search`` by their name finds
    (their own document ranks first): (cities and universities, companies), each ``(name, year, doc_id)``,
    and every word the world's names use."""
    from tools_env.corpus import build_world
    from tools_env.tools.search import BM25Index

    world = build_world(corpus_seed)
    index = BM25Index(world.docs)

    def found(name: str) -> bool:
        hits = index.search(name, 1)
        return bool(hits) and hits[0][0].id == world.doc_id[name]

    early = [(n, c["founded"], world.doc_id[n]) for n, c in world.cities.items()] + [
        (n, u["founded"], world.doc_id[n]) for n, u in world.universities.items()
    ]
    late = [(n, c["year"], world.doc_id[n]) for n, c in world.companies.items()]
    names = [*world.cities, *world.universities, *world.companies, *world.people, *world.countries]
    return [e for e in early if found(e[0])], [e for e in late if found(e[0])], {w for n in names for w in n.split()}


def _unknown_word(rng: random.Random, taken: set[str]) -> str:
    """A name-word the world does not use, shaped like its own."""
    from tools_env.corpus.generate import _Names

    names = _Names(rng)
    names.used = set(taken)  # a copy: the word it draws must not join the cached world's words
    return names.word(2)


def _multistep(
    rng: random.Random, corpus_seed: int = CORPUS_SEED, missing: bool = False
) -> tuple[str, str, dict, dict]:
    """Two entities' founding years and their difference: a city or university of the world, then, where
    ``missing``, a company the world lacks (a search finds another company's year; its year drawn as the world
    draws them), else one of its companies founded later. ``meta.searchable``: the
    search finds both; ``meta.search_queries``: the two names, which a simulated expert asked to write a
    search writes in turn (``Expert.write_query``); ``meta.evidence``, where both are found: their documents'
    ids, with which in the tool results a simulated expert writing the answer has what the difference follows
    from."""
    from tools_env.corpus.generate import COMPANY_SUFFIX

    early, late, words = founding_years(corpus_seed)
    a, year_a, doc_a = rng.choice(early)
    candidates = [x for x in late if x[1] > year_a]
    if candidates and not missing:
        (b, year_b, doc_b), found = rng.choice(candidates), True
    else:
        b = f"{_unknown_word(rng, words)} {rng.choice(COMPANY_SUFFIX)}"
        year_b, found = rng.randint(max(1925, year_a + 1), max(2035, year_a + 1)), False
    problem = f"How many years after the founding of {a} was {b} founded?"
    meta: dict = {"searchable": found, "search_queries": [a, b]}
    if found:
        meta["evidence"] = [f"[{doc_a}]", f"[{doc_b}]"]
    return problem, str(year_b - year_a), {"type": "numeric", "abs_tol": 1e-6}, meta


_MAKERS = {"arithmetic": _arithmetic, "lookup": _lookup, "reasoning": _reasoning}


def make_task(rng: random.Random, category: str, corpus_seed: int = CORPUS_SEED, missing: bool = False) -> TaskRecord:
    """A task of ``category``; a multi-step one about the search tool's world of ``corpus_seed``, naming an entity
    it lacks where ``missing``."""
    if category == CHAIN:
        problem, answer, verifier, *extra = _multistep(rng, corpus_seed, missing)
    else:
        problem, answer, verifier, *extra = _MAKERS[category](rng)
    if category == CHAIN:
        tools = list(MULTISTEP_TOOLS)
    else:
        tools = (
            ["calculator", "expert", "answer"]
            if category == "arithmetic" or rng.random() < 0.3
            else ["expert", "answer"]
        )
    prices = {
        alias: {"input": round(pin * rng.uniform(0.7, 1.3), 4), "output": round(pout * rng.uniform(0.7, 1.3), 4)}
        for alias, (pin, pout) in EXPERT_PRICES.items()
    }
    pref_name = rng.choice(sorted(PREFERENCES))
    return TaskRecord(
        problem=problem,
        answer=answer,
        category=category,
        tools=tools,
        prices=prices,
        preference=dict(PREFERENCES[pref_name].weights),
        verifier=verifier,
        max_turns=MULTISTEP_TURNS if category == CHAIN else None,
        meta={"preference_name": pref_name, **(extra[0] if extra else {})},
    )


def _wide_arithmetic(rng: random.Random) -> tuple[str, str, dict]:
    """Operands of 1 to 4 digits: results of 1 to 8 characters, some negative."""
    a, b = (rng.randint(0, 10 ** rng.randint(1, 4) - 1) for _ in range(2))
    return _posed(a, b, rng)


def _repeated_digit_arithmetic(rng: random.Random) -> tuple[str, str, dict]:
    """The default set's operands (10 to 99 and 2 to 99), one or both a repdigit (11 to 99). A copy
    that finds its next token by what followed the current one in the source has two candidates after
    a repeated digit (in "61 - 33" a "3" is followed by "3" and by "?"), so these are the copies a
    small model gets wrong: it drops a digit ("61 - 3"), doubles one ("66") or stops early."""
    a, b = rng.randint(10, 99), rng.randint(2, 99)
    which = rng.choice(("a", "b", "ab"))
    if "a" in which:
        a = 11 * rng.randint(1, 9)
    if "b" in which:
        b = 11 * rng.randint(1, 9)
    return _posed(a, b, rng)


def copy_tasks(
    n: int, seed: int, categories: str | tuple[str, ...] = DEFAULT_CATEGORIES, corpus_seed: int = CORPUS_SEED
) -> list[TaskRecord]:
    """Tasks for the warm start's copy lessons (``data.warm_start``), categories in rotation: the
    default lookups and puzzles, whose answers an expert states inside a sentence, and arithmetic of
    three shapes in turn. A third has operands of 1 to 4 digits, so calculator results of 1 to 8
    characters; a third has the default set's operands (10 to 99 and 2 to 99), so results of 1 to 4
    digits, negatives down to -89, and 4-digit products as often as the tasks the run is judged on
    have them: lessons of the wide shape alone leave the copy of those unlearned (docs/algorithm.md);
    a third has those operands with a repdigit (``_repeated_digit_arithmetic``), where the trained
    policy's copies went wrong most. No multi-step lessons: the chain's calls copy nothing (experts write
    its queries and its answer)."""
    rng, categories = random.Random(seed), tuple(c for c in category_list(categories) if c != CHAIN)
    if not categories:
        return []
    tasks = []
    for i in range(n):
        category = categories[i % len(categories)]
        task = make_task(rng, category, corpus_seed)
        shape = (i // len(categories)) % 3
        if category == "arithmetic" and shape != 1:
            make = _wide_arithmetic if shape == 0 else _repeated_digit_arithmetic
            task.problem, task.answer, task.verifier = make(rng)
        task.id = f"copy-{seed}-{i:05d}"
        tasks.append(task)
    return tasks


def generate_tasks(
    n: int, seed: int, categories: str | tuple[str, ...] = DEFAULT_CATEGORIES, corpus_seed: int = CORPUS_SEED
) -> list[TaskRecord]:
    """``n`` tasks, ``categories`` (``data.categories``) in rotation, deterministic in ``seed``; ids unique
    within the set."""
    rng, categories = random.Random(seed), category_list(categories)
    tasks = []
    for i in range(n):
        category = categories[i % len(categories)]
        missing = category == CHAIN and (i // len(categories)) % MISSING_EVERY == MISSING_EVERY - 1
        task = make_task(rng, category, corpus_seed, missing)
        task.id = f"default-{seed}-{i:05d}"
        tasks.append(task)
    return tasks


def plan_phrases(categories: str | tuple[str, ...] = DEFAULT_CATEGORIES) -> list[str]:
    """Every plan a turn of the default task set can open with (``plan``, for each kind,
    preference and call the warm start makes: an expert alias asked or writing the answer, the
    calculator, or answering itself) and the expert aliases. The embedded tokenizer keeps each one
    a single token ("tool tokens", as in ToolkenGPT, Hao et al. 2023): one token names the action
    for this kind of task under this preference, so a tool choice has an output row of its own per
    (kind, preference) that GRPO moves without moving the same choice elsewhere."""
    categories = category_list(categories)
    calls = [(tool, {"model": alias}) for tool in ("answer", "expert") for alias in EXPERT_PRICES] + [
        ("calculator", {}),
        *([("search", {"model": alias}) for alias in EXPERT_PRICES] if CHAIN in categories else []),
        ("answer", {}),
    ]
    return [
        plan(category, name, tool, args) for category in categories for name in PREFERENCES for tool, args in calls
    ] + list(EXPERT_PRICES)


def plan(category: str, name: str | None, tool: str, arguments: dict) -> str:
    """``"<kind>, <label>: <action>"``, e.g. ``puzzle, cheap: answer by expert-medium``."""
    head = KINDS.get(category, category) + (f", {PREFERENCES[name].label}" if name in PREFERENCES else "")
    if "model" in arguments:
        return f"{head}: {'ask' if tool == 'expert' else tool + ' by'} {arguments['model']}"
    return f"{head}: {tool}"


def plan_head(category: str, name: str | None) -> str | None:
    """What a plan restates from the task it serves, ``"<kind>, <label>"`` (``"puzzle, cheap"``): the kind of
    ``category`` and the preference profile ``name``'s word; None when the task has no kind or no profile of
    the default task set (its plans are not read)."""
    if category not in KINDS or name not in PREFERENCES:
        return None
    return f"{KINDS[category]}, {PREFERENCES[name].label}"


_HEAD = "({kinds}), ({labels}): ".format(  # a plan's head as the grammar writes it: "<kind>, <label>: "
    kinds="|".join(map(re.escape, KINDS.values())),
    labels="|".join(re.escape(p.label) for p in PREFERENCES.values()),
)
_STATED_PLAN = re.compile(r"\s*<think>" + _HEAD)  # a turn that opens with a plan
_PLAN_TOKEN = re.compile(_HEAD + r"\S.*")  # a whole plan, as one token's text


def plan_positions(traj: Trajectory, chat: ChatFormat) -> list[tuple[int, tuple[int, ...]]]:
    """The turns of ``traj`` whose plan is one token (the embedded tokenizer's ``plan_phrases``): the token's
    index in ``traj.token_ids`` and the ids of every one-token plan that states the task's kind and preference
    right (``plan_head``), whatever its action. Nothing for a task without a head, nor for a turn whose plan is
    free text or written in several tokens."""
    head = plan_head(traj.task.category, traj.task.meta.get("preference_name"))
    if head is None:
        return []
    think, ids = chat.encode("<think>"), traj.token_ids
    out = []
    for turn in traj.turns:
        k = None if turn.start is None else turn.start + len(think)
        if (
            k is not None
            and k < len(ids)
            and ids[turn.start : k] == think
            and _PLAN_TOKEN.fullmatch(chat.decode([ids[k]]))
        ):
            out.append((k, chat.tokens_starting(f"{head}: ")))
    return out


def misstated_plan(category: str, name: str | None, text: str) -> str | None:
    """The head a turn's plan should have written (``plan_head``) when the turn ``text`` opens with a plan
    that states another kind or preference than its task's; None when it states them right, when the turn
    opens with no plan of this grammar (free thinking is not read), or when the task has no head. The plan
    restates what the prompt says; only its action is the policy's choice."""
    head = plan_head(category, name)
    stated = _STATED_PLAN.match(text)
    if head is None or stated is None or f"{stated.group(1)}, {stated.group(2)}" == head:
        return None
    return head


def plan_text(category: str, name: str | None, tool: str, arguments: dict) -> str:
    """The short plan an orchestrator turn opens with, in a ``<think>`` block (ToolOrchestra's turns
    reason before they call a tool): the kind of task, the user's preference in a word, and the
    call it is about to make, e.g. ``<think>puzzle, cheap: answer by expert-medium</think>``.
    The warm start writes it from the task record and its (random) choice. With the embedded
    tokenizer the plan between the tags is one token (``plan_phrases``): the policy states the
    kind and the preference it read and picks the action in one step."""
    return f"<think>{plan(category, name, tool, arguments)}</think>\n"
