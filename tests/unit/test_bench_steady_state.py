"""The GRPO benchmark measures rollouts ahead of training in their steady state.

A fake trainer takes its rollouts from ``RolloutsAhead`` (each one R seconds: R/2 of it in a
"generate call", R/2 waiting on "tools", any number at once) and trains T seconds a step. A step's
rollouts start when step s - K begins, so the step beginnings b follow

    b[s+1] = max(b[s], b[s-K] + R) + T

and with R > K T (the rollouts bound the step) the steps come in periods of K + 1: one waits, K do
not, and the period lasts R + T. The steady step time is (R + T) / (K + 1), and over a period the engine
is busy from the first of K + 1 rollout starts spaced T apart to the last one's end: R/2 + K T. The first
step starts the rollouts of steps 0..K together, so steps 1..K find theirs done: measured from there over
a part of a period, the steps read faster than the steady state.
"""

import asyncio
import statistics
import time
from types import SimpleNamespace

import pytest

from benchmarks.grpo import plan_steps, run_steps, summarize
from nemo_orchestra.rollout.managed_engine import GenerateCalls
from nemo_orchestra.train.rollout_source import RolloutsAhead

K, R, T = 4, 0.4, 0.02
OVERRUN_S = 0.03


class FakeTrainer:
    """``grpo_step()`` as the trainer's, for the metrics the benchmark reads."""

    def __init__(self, last_step: int):
        self.step = 0
        self.generation = SimpleNamespace(calls=GenerateCalls())
        self.loop = asyncio.new_event_loop()
        self.rollouts = RolloutsAhead(self.loop, self.rollout, K, last_step)
        self.rollout_s: list[float] = []
        self.generate_s: list[float] = []

    async def rollout(self, step: int) -> int:
        t0 = time.perf_counter()
        with self.generation.calls.call():
            await asyncio.sleep(R / 2)
        self.generate_s.append(time.perf_counter() - t0)
        await asyncio.sleep(R / 2)
        return step

    def grpo_step(self) -> dict:
        t0 = time.perf_counter()
        _, waited = self.rollouts.take(self.step)
        started, finished = self.rollouts.started[self.step], self.rollouts.finished[self.step]
        self.rollout_s.append(finished - started)
        time.sleep(T)
        step_s = time.perf_counter() - t0
        return {
            "time/step_s": step_s,
            "time/rollout_wait_s": waited,
            "time/rollout_s": waited,
            "time/rollouts_started_s": started - t0,
            "time/rollouts_finished_s": finished - t0,
            "perf/tokens_per_s": 100 / step_s,
            "perf/generated_tokens": 50,
        }

    def close(self) -> None:
        self.rollouts.close()
        self.loop.close()


def measure(warmup: int, steps: int, tries: int = 3) -> tuple[dict, dict, float, float]:
    """The benchmark's summary and run record of ``warmup`` + ``steps`` fake steps (run K steps longer,
    as the benchmark runs), and the steady step time and engine idle share for the R and T they took.
    A run in which a sleep overran by more than ``OVERRUN_S`` (a loaded machine) is taken again, up to
    ``tries`` times: the figures assume every step alike."""
    for _ in range(tries):
        trainer = FakeTrainer(warmup + steps + K)
        try:
            measured, run = run_steps(trainer, warmup, steps)
        finally:
            trainer.close()
        trains = [m["time/step_s"] - m["time/rollout_wait_s"] for m in measured]
        overran = max(trains) - T, max(trainer.rollout_s) - R, max(trainer.generate_s) - R / 2
        if max(overran) < OVERRUN_S:
            break
    r, t = statistics.fmean(trainer.rollout_s), statistics.fmean(trains)
    assert r > 2 * K * t, "the rollouts must bound the step for the figures below"
    return summarize(measured), run, (r + t) / (K + 1), 1 - (r / 2 + K * t) / (r + t)


def test_the_benchmark_measures_the_steady_state_and_a_one_step_warmup_would_not():
    warmup, steps, notes = plan_steps(K, "auto", 8)
    assert (warmup, steps) == (K + 1, 2 * (K + 1)) and len(notes) == 1  # 8 steps: rounded to whole periods
    summary, run, steady_s, idle = measure(warmup, steps)
    assert summary["step_s"] == pytest.approx(steady_s, rel=0.12)
    assert run["engine_idle_share"] == pytest.approx(idle, abs=0.1)
    # one step in K + 1 waits for its rollouts: R - K T of each period's R + T
    assert summary["rollout_wait_share"] == pytest.approx((steady_s - T) / steady_s, abs=0.15)
    timeline = run["timeline"]
    assert [e["phase"] for e in timeline] == ["warmup"] * warmup + ["measured"] * steps
    assert all(a["end_s"] <= b["start_s"] for a, b in zip(timeline, timeline[1:]))
    # no measured step's rollouts started with the first step's: each began K steps before its own
    for e in timeline[warmup:]:
        assert e["step"] - K >= 1
        assert e["rollouts_started_s"] == pytest.approx(timeline[e["step"] - K]["start_s"], abs=0.05)
        assert e["rollouts_started_s"] < e["rollouts_finished_s"] <= e["start_s"] + e["rollout_wait_s"] + 0.05

    # the measurement before: one warm-up step, then 8 measured, 4 of them on the first step's rollouts
    biased, run, steady_s, _ = measure(1, 8)
    assert biased["step_s"] < 0.85 * steady_s, (biased["step_s"], steady_s)
    head_start = [e for e in run["timeline"][1:] if e["rollouts_started_s"] < run["timeline"][0]["end_s"]]
    assert len(head_start) == K


def test_the_warmup_is_at_least_k_plus_1_steps_and_the_steps_whole_periods():
    assert plan_steps(0, "auto", 3) == (1, 3, [])
    assert plan_steps(2, 6, 9) == (6, 9, [])
    warmup, steps, notes = plan_steps(0, 0, 2)
    assert (warmup, steps) == (1, 2) and notes == [
        "--warmup 0 raised to 1 (rollout.steps_ahead + 1, the least): the first step's one-time costs stay out "
        "of the measurement"
    ]
    warmup, steps, notes = plan_steps(4, 1, 3)
    assert (warmup, steps) == (5, 5) and "--warmup 1 raised to 5" in notes[0] and "steps 1..4" in notes[0]
    assert notes[1].startswith("--steps 3 rounded up to 5")


def test_engine_busy_time_is_the_union_of_its_calls_within_the_window():
    now = [0.0]
    calls = GenerateCalls(clock=lambda: now[0])

    def call(start, end, sequences):
        now[0] = start
        with calls.call(sequences):
            now[0] = end

    for start, end, sequences in [(1, 2, 4), (1.5, 3, 8), (5, 6, 16)]:
        call(start, end, sequences)
    assert calls.busy_s(0, 10) == 3.0 and calls.busy_s(2.5, 5.5) == 1.0 and calls.busy_s(7, 9) == 0.0
    assert (
        calls.started_in(0, 10) == (3, 28) and calls.started_in(1.2, 5) == (2, 24) and calls.started_in(7, 9) == (0, 0)
    )
    now[0] = 8
    with calls.call():  # running: busy up to the window's end
        assert calls.busy_s(7, 9) == 1.0
    kept = GenerateCalls(keep=2, clock=lambda: now[0])
    for start, end in [(1, 2), (3, 4), (5, 6)]:
        now[0] = start
        with kept.call():
            now[0] = end
    assert kept.busy_s(0, 10) is None and kept.busy_s(3, 10) == 2.0  # the first call is no longer kept
    assert kept.started_in(0, 10) is None and kept.started_in(3, 10) == (2, 0)


def test_graphs_captured_in_the_measured_steps_are_reported():
    """A decode shape first met in a measured step (the megatron engine captures it as a CUDA graph then) is
    that step's, in the timeline and in the measured steps' sum."""
    captures = {0: (3, 0.3), 1: (1, 0.1), 3: (2, 0.25)}  # step -> (shapes, seconds) the engine captures in it

    class Trainer:
        step = 0

        def __init__(self):
            self.generation = SimpleNamespace(calls=GenerateCalls(), engine=None)

        def grpo_step(self):
            if self.step == 1:  # the engine starts at the first weight sync
                self.generation.engine = SimpleNamespace(graphs_captured=3, capture_s=0.3)
            engine = self.generation.engine
            if engine is not None and self.step in captures and self.step > 0:
                n, s = captures[self.step]
                engine.graphs_captured, engine.capture_s = engine.graphs_captured + n, engine.capture_s + s
            return {"time/step_s": 0.01, "perf/tokens_per_s": 1.0, "perf/generated_tokens": 1}

    lines = []
    _, run = run_steps(Trainer(), 2, 3, lines.append)
    assert [e["graphs_captured"] for e in run["timeline"]] == [0, 4, 0, 2, 0]
    assert [e["capture_s"] for e in run["timeline"]] == pytest.approx([0, 0.4, 0, 0.25, 0])
    assert run["graphs_captured_measured"] == 2 and run["capture_s_measured"] == pytest.approx(0.25)
    assert "2 decode shapes captured as CUDA graphs (0.25 s)" in lines[3] and "captured" not in lines[2]
