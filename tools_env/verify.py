"""Answer verification: the outcome of an episode.

A task's ``verifier`` picks the check by its ``type``, looked up in ``VERIFIERS``:

- ``exact`` (default): normalized exact match — lower case, punctuation dropped, the
  articles a/an/the dropped, whitespace collapsed (the SQuAD normalization). Optional
  ``aliases: [str]`` are further accepted answers.
- ``numeric``: ``math.isclose(pred, gold, rel_tol, abs_tol)`` (defaults 1e-6, 1e-9). Numbers
  parse from "1,234", "3.0", "-2.5e3", "3/4", "$12", "50%" (-> 50), "\\boxed{7}"; an answer
  that is not a number as a whole is judged by the last number in it ("x = 42" -> 42).
- ``judge``: exact match first (free); otherwise an OpenAI-compatible LLM judge from the
  service config is asked whether the prediction matches the gold answer.
- ``db_state``: domain tasks; registered by ``tools_env.domains`` when it is imported (the
  service imports it), which replays the gold actions and compares databases.

Other packages add types with ``register_verifier``. A verifier type nobody registered is an
``UnknownVerifierError`` naming it (the service refuses such a task when the episode is
created); a package that cannot provide its type here (a missing optional dependency) says why
with ``register_unavailable``, and that reason is the error. A multi-turn type also registers a
turn hook (``register_turn_hook``): ``answer`` then ends a user turn, and the hook returns the
next user turn, which the policy reads as the answer's observation, or None after the last. A registered verifier that fails (no judge configured, judge unreachable, a domain
bug) gives an incorrect outcome whose ``reason`` says why, never an exception.
"""

from __future__ import annotations

import inspect
import math
import re
import string
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Awaitable, Callable, Protocol, Union

from tools_env.task import TaskRecord


@dataclass
class Outcome:
    correct: bool
    score: float
    reason: str
    # a task judged user turn by user turn (BFCL): whether each passed, in order, a turn never reached as
    # failed; None: judged as a whole
    turn_passed: list[bool] | None = None
    # the grader's own record of the episode, JSON-safe (tau2: its SimulationRun as tau2 serialises it);
    # None: the grader keeps none
    record: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The outcome as the service returns it; ``turn_passed`` and ``record`` only where set."""
        out = asdict(self)
        for key in ("turn_passed", "record"):
            if out[key] is None:
                del out[key]
        return out


def _ok(reason: str) -> Outcome:
    return Outcome(True, 1.0, reason)


def _wrong(reason: str) -> Outcome:
    return Outcome(False, 0.0, reason)


_PUNCT = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    s = s.lower().translate(_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(pred: str, gold: str, aliases: list[str] = ()) -> Outcome:
    p = normalize_answer(pred)
    for g in (gold, *aliases):
        if p == normalize_answer(g):
            return _ok("exact match" if g == gold else f"exact match with alias {g!r}")
    return _wrong(f"normalized {p!r} != {normalize_answer(gold)!r}")


_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?"
_FULL_NUMBER = re.compile(rf"^\s*({_NUM})\s*(?:/\s*({_NUM}))?\s*%?\s*$")
_ANY_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")


def _to_float(num: str, den: str | None) -> float | None:
    num = num.replace(",", "")
    if not num or not any(c.isdigit() for c in num):
        return None
    try:
        if den is None:
            value = float(num)
        else:
            den = den.replace(",", "")
            if "." in num + den or "e" in (num + den).lower():
                value = float(num) / float(den)
            else:
                value = float(Fraction(int(num), int(den)))
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def parse_number(s: str) -> float | None:
    """The number a whole answer string denotes, or None (see the module docstring)."""
    s = s.strip()
    m = re.fullmatch(r"\\boxed\{(.*)\}", s)
    if m:
        s = m.group(1)
    m = re.fullmatch(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", s.strip())
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    s = s.strip().lstrip("$").rstrip(".").strip()
    m = _FULL_NUMBER.match(s)
    return _to_float(m.group(1), m.group(2)) if m else None


def extract_number(s: str) -> float | None:
    """``parse_number`` of the whole string, else the last number found in it."""
    value = parse_number(s)
    if value is not None:
        return value
    found = _ANY_NUMBER.findall(s)
    return parse_number(found[-1]) if found else None


def numeric_match(pred: str, gold: str, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> Outcome:
    g = extract_number(gold)
    if g is None:
        return _wrong(f"gold answer {gold!r} is not a number")
    p = extract_number(pred)
    if p is None:
        return _wrong(f"could not parse a number from {pred!r}")
    if math.isclose(p, g, rel_tol=rel_tol, abs_tol=abs_tol):
        return _ok(f"{p!r} matches {g!r} within tolerance")
    return _wrong(f"{p!r} != {g!r} (rel_tol={rel_tol}, abs_tol={abs_tol})")


class Verifier(Protocol):
    """``verifier(answer, task, ctx, judge) -> Outcome`` (or an awaitable of one).

    ``ctx`` is the episode's ``EpisodeContext`` (its workdir, its state); ``judge`` is an object
    with ``async grade(problem, gold, pred) -> (bool, str)`` or None when none is configured.
    """

    def __call__(self, answer: str, task: TaskRecord, ctx: Any, judge: Any) -> Union[Outcome, Awaitable[Outcome]]: ...


class UnknownVerifierError(ValueError):
    """A task names a verifier type that nothing registered."""


VERIFIERS: dict[str, Verifier] = {}
UNAVAILABLE: dict[str, str] = {}  # verifier type -> why its package could not register it
TURN_HOOKS: dict[str, Callable[[str, TaskRecord, Any], Union[str, None]]] = {}


def register_verifier(kind: str, verifier: Verifier) -> Verifier:
    """Make ``verifier`` the check of tasks whose ``verifier.type`` is ``kind``."""
    known = VERIFIERS.get(kind, verifier)
    if (known.__module__, known.__qualname__) != (verifier.__module__, verifier.__qualname__):  # a reload is fine
        raise ValueError(f"verifier type {kind!r} is already registered by {known.__module__}")
    VERIFIERS[kind] = verifier
    return verifier


def register_unavailable(kind: str, reason: str) -> None:
    """``kind`` cannot be verified in this process: ``reason`` (naming what to install) is its error."""
    UNAVAILABLE[kind] = reason


USER_REQUIRED: dict[str, str] = {}  # verifier type -> why its tasks need the service's ``user``


def register_turn_hook(kind: str, hook: Callable[..., Any], needs_user: str = "") -> None:
    """``hook(answer, task, ctx, user)`` runs when ``answer`` is called in a ``kind`` task: the next user
    turn or None (``user``: the service's ``user`` config; the hook may be a coroutine function).
    ``needs_user``: why such a task cannot run without a configured user (the service then refuses it)."""
    TURN_HOOKS[kind] = hook
    if needs_user:
        USER_REQUIRED[kind] = needs_user


async def next_user_turn(answer: str, task: TaskRecord, ctx: Any, user: Any = None) -> str | None:
    """The next user turn of a multi-turn task, after checking the turn ``answer`` ended; None: the episode ends."""
    hook = TURN_HOOKS.get(verifier_type(task))
    if hook is None:
        return None
    out = hook(answer, task, ctx, user)
    return await out if inspect.isawaitable(out) else out


def get_verifier(kind: str) -> Verifier:
    if kind in UNAVAILABLE and kind not in VERIFIERS:
        raise UnknownVerifierError(f"verifier type {kind!r} is unavailable: {UNAVAILABLE[kind]}")
    if kind not in VERIFIERS:
        hint = " (it is registered by importing tools_env.domains)" if kind == "db_state" else ""
        raise UnknownVerifierError(
            f"verifier type {kind!r} is not registered{hint}; registered types: {', '.join(sorted(VERIFIERS))}"
        )
    return VERIFIERS[kind]


def verifier_type(task: TaskRecord) -> str:
    return (task.verifier or {}).get("type", "exact")


def _exact(answer: str, task: TaskRecord, ctx: Any, judge: Any) -> Outcome:
    return exact_match(answer, task.answer, (task.verifier or {}).get("aliases", []))


def _numeric(answer: str, task: TaskRecord, ctx: Any, judge: Any) -> Outcome:
    spec = task.verifier or {}
    return numeric_match(answer, task.answer, float(spec.get("rel_tol", 1e-6)), float(spec.get("abs_tol", 1e-9)))


async def _judge(answer: str, task: TaskRecord, ctx: Any, judge: Any) -> Outcome:
    first = _exact(answer, task, ctx, judge)
    if first.correct:
        return first
    if judge is None:
        return _wrong("judge verifier requested but no judge endpoint is configured (config 'judge')")
    try:
        correct, reason = await judge.grade(task.problem, task.answer, answer)
    except Exception as e:
        return _wrong(f"judge failed: {type(e).__name__}: {e}")
    return Outcome(correct, 1.0 if correct else 0.0, f"judge: {reason}")


register_verifier("exact", _exact)
register_verifier("numeric", _numeric)
register_verifier("judge", _judge)


async def verify(answer: str, task: TaskRecord, ctx: Any = None, judge: Any = None) -> Outcome:
    """Judge ``answer`` against ``task`` with the verifier its ``verifier.type`` names.

    Raises ``UnknownVerifierError`` when no verifier of that type is registered; a registered
    verifier that raises gives an incorrect outcome naming the exception.
    """
    kind = verifier_type(task)
    verifier = get_verifier(kind)
    try:
        result = verifier(answer, task, ctx, judge)
        if inspect.isawaitable(result):
            result = await result
    except Exception as e:  # a verifier bug must not lose the episode
        return _wrong(f"{kind} verifier failed: {type(e).__name__}: {e}")
    return result
