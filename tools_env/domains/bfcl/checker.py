"""BFCL's multi-turn checker, turn by turn, on an episode's own instances.

Our implementation of ``bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker`` (v4). An
episode holds two sets of API instances loaded with the entry's initial configuration: the
policy's, on which its calls run, and the ground truth's, on which BFCL's ground-truth calls of
each turn run when the policy ends that turn (``answer``). At the end of turn k:

1. a turn whose ground truth makes calls needs at least one call from the policy in that turn;
2. state: every public attribute (name not starting with ``_``) of every ground-truth instance
   equals the policy instance's (``!=`` as BFCL compares them; the file system compares trees);
3. execution results: the ground truth's results of turn k are contained, as a multiset and in
   any order, in the results of all the policy's calls so far (all turns: a lookup made one turn
   early still counts).

A turn whose ground truth is empty (``miss_param``: the request cannot be done) is passed when
the policy makes no call in it (BFCL's irrelevance check); its calls still run, so later turns
see their effect. BFCL stops at the first failing turn; here every turn is checked and each
failed one gives a reason. The entry passes when no turn failed, the same verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tools_env.domains.bfcl.apis import execute, new_instances, parse_call, public_state

MAX_DIFFS = 3  # differing values named per instance
MAX_CHARS = 160  # characters of a value shown in a reason


@dataclass
class BfclEpisode:
    """One episode's BFCL state: both instance sets, the turn, the results of the policy's calls."""

    entry: dict[str, Any]  # the task's meta["bfcl"]
    instances: dict[str, Any]  # the policy's
    truth: dict[str, Any]  # the ground truth's
    turn: int = 0
    turn_results: list[str] = field(default_factory=list)
    all_results: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    passed: list[bool] = field(default_factory=list)  # each checked turn's verdict
    finished: bool = False

    @property
    def num_turns(self) -> int:
        return len(self.entry["turns"])


def episode_state(ctx: Any) -> BfclEpisode:
    """The episode's BFCL state, created from its task on first use (instances of its own)."""
    state = ctx.state.get("bfcl")
    if state is None:
        entry = (ctx.task.meta or {}).get("bfcl")
        if not isinstance(entry, dict):
            raise ValueError(
                f"task {ctx.task.id} has no meta.bfcl entry (write BFCL tasks with recipes/import_bfcl.py)"
            )
        cfg = entry["initial_config"], bool(entry.get("long_context", False))
        state = BfclEpisode(
            entry, new_instances(entry["involved_classes"], *cfg), new_instances(entry["involved_classes"], *cfg)
        )
        ctx.state["bfcl"] = state
    return state


def run_call(ctx: Any, name: str, arguments: dict[str, Any]) -> str:
    """Execute one of the policy's calls on its instances; the result is recorded for the checks."""
    state = episode_state(ctx)
    result = execute(state.instances, name, (), arguments)
    state.turn_results.append(result)
    state.all_results.append(result)
    return result


def end_turn(ctx: Any) -> str | None:
    """Check the turn the policy just ended; the next user turn's text, or None after the last."""
    state = episode_state(ctx)
    assert not state.finished, "a finished BFCL episode takes no more turns"
    calls = state.entry["ground_truth"][state.turn]
    truth_results = [execute(state.truth, name, args, kwargs) for name, args, kwargs in map(parse_call, calls)]
    reason = check_turn(state, calls, truth_results)
    if reason is not None:
        state.failures.append(f"turn {state.turn}: {reason}")
    state.passed.append(reason is None)
    state.turn += 1
    state.turn_results = []
    if state.turn < state.num_turns:
        request = state.entry["turns"][state.turn]
        return f"Turn {state.turn} of {state.num_turns} done. The user's next request: {request}"
    state.finished = True
    return None


def check_turn(state: BfclEpisode, calls: list[str], truth_results: list[str]) -> str | None:
    """Why the turn fails BFCL's checks, or None when it passes."""
    if not calls:
        if state.turn_results:
            return (
                "the ground truth makes no call in this turn (the request cannot be done), "
                f"the policy made {len(state.turn_results)}"
            )
        return None
    if not state.turn_results:
        return f"no function call in this turn; the ground truth makes {len(calls)}"
    checks = (state_mismatch(state.instances, state.truth), missing_results(state.all_results, truth_results))
    reasons = [r for r in checks if r is not None]
    return "; ".join(reasons) or None


def state_mismatch(instances: dict[str, Any], truth: dict[str, Any]) -> str | None:
    """The instances whose public state differs from the ground truth's, with the differing values."""
    parts = []
    for cls, want in truth.items():
        got_state, want_state = public_state(instances[cls]), public_state(want)
        diffs = [
            d
            for attr, value in want_state.items()
            if got_state.get(attr) != value
            for d in _diff(got_state.get(attr), value, attr)
        ]
        if diffs:
            more = f"; {len(diffs) - MAX_DIFFS} more" if len(diffs) > MAX_DIFFS else ""
            shown = "; ".join(diffs[:MAX_DIFFS]) + more
            parts.append(f"{cls} state differs from the ground truth's: {shown}")
    return " | ".join(parts) or None


def missing_results(policy_results: list[str], truth_results: list[str]) -> str | None:
    """The ground truth's results of this turn not found among the policy's results so far (as a multiset)."""
    pool, missing = list(policy_results), []
    for result in truth_results:
        if result in pool:
            pool.remove(result)
        else:
            missing.append(result)
    if not missing:
        return None
    return f"execution results missing from the policy's calls: {', '.join(_short(m) for m in missing[:MAX_DIFFS])}"


def final_outcome(ctx: Any) -> tuple[bool, str, list[bool]]:
    """The entry's verdict, its reason, and each user turn's (a turn never reached: failed)."""
    state = ctx.state.get("bfcl")
    num_turns = len((ctx.task.meta or {}).get("bfcl", {}).get("turns", [])) if state is None else state.num_turns
    passed = ([] if state is None else list(state.passed)) + [False] * num_turns
    passed = passed[:num_turns]
    if state is None or not state.finished:
        done = 0 if state is None else state.turn
        return False, f"the episode ended after {done} of its user turns", passed
    if state.failures:
        reason = f"{len(state.failures)} of {state.num_turns} turns failed: " + " || ".join(state.failures)
        return False, reason, passed
    return True, f"all {state.num_turns} turns match the ground truth's state and execution results", passed


def _diff(got: Any, want: Any, path: str, seen: frozenset = frozenset()) -> list[str]:
    """The leaves where ``got`` and ``want`` differ, as ``path: got X, want Y``."""
    if got == want:
        return []
    if isinstance(got, dict) and isinstance(want, dict):
        return [
            d
            for k in sorted(set(got) | set(want), key=str)
            if got.get(k, _ABSENT) != want.get(k, _ABSENT)
            for d in _diff(got.get(k, _ABSENT), want.get(k, _ABSENT), f"{path}[{k!r}]", seen)
        ]
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _diff(g, w, f"{path}[{i}]", seen)]
    if type(got) is type(want) and hasattr(want, "__dict__") and id(want) not in seen:  # a file system node
        seen = seen | {id(want)}
        g, w = public_state(got), public_state(want)
        return [d for k in w if k != "parent" for d in _diff(g.get(k, _ABSENT), w[k], f"{path}.{k}", seen)]
    return [f"{path}: got {_short(got)}, want {_short(want)}"]


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS] + "..."
