"""Rollouts ahead of training on a CPU: the vLLM engine's worker and the trainer split the cores."""

import os

import pytest
import torch

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.rollout.engines.vllm_memory import pinned_to
from nemo_orchestra.train.run_plan import engine_cpus, live_sequences, overlap_reference

CPU = torch.device("cpu")


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3, 3 + n)))

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    return set_cores


def test_the_engine_gets_the_first_half_of_the_cores_when_rollouts_run_ahead(cores):
    ahead = load_config(["rollout.steps_ahead=1", "loss.tis_cap=2.0"])
    cores(2)
    assert engine_cpus(ahead, CPU) == [3]
    cores(16)
    assert engine_cpus(ahead, CPU) == list(range(3, 11))


def test_nothing_changes_otherwise(cores, monkeypatch):
    cores(16)
    assert engine_cpus(load_config([]), CPU) is None  # synchronous
    ahead = ["rollout.steps_ahead=1", "loss.tis_cap=2.0"]
    assert engine_cpus(load_config([*ahead, "rollout.engine=hf"]), CPU) is None
    assert engine_cpus(load_config(ahead), torch.device("cuda", 0)) is None
    cores(1)
    assert engine_cpus(load_config(ahead), CPU) is None
    cores(16)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    assert engine_cpus(load_config(ahead), CPU) is None  # the user's binding stands


def test_the_reference_runs_beside_the_update_where_the_engine_has_cores_of_its_own(cores):
    ahead = ["rollout.steps_ahead=1", "loss.tis_cap=2.0"]
    cores(2)
    assert overlap_reference(load_config(ahead), CPU)
    assert not overlap_reference(load_config([]), CPU)  # synchronous: the trainer has every core
    assert not overlap_reference(load_config([*ahead, "loss.kl_coef=0"]), CPU)  # no reference pass
    assert not overlap_reference(load_config([*ahead, "reference.offload=true"]), CPU)
    assert not overlap_reference(load_config([*ahead, "parallel.tp=2"]), CPU)
    assert not overlap_reference(load_config(ahead), torch.device("cuda", 0))
    assert not overlap_reference(load_config([*ahead, "perf.overlap_reference=false"]), CPU)
    assert overlap_reference(load_config(["perf.overlap_reference=true"]), CPU)  # asked for
    for bad in ("parallel.tp=2", "parallel.pp=2", "reference.offload=true"):
        with pytest.raises(ConfigError, match="perf.overlap_reference"):
            load_config(["perf.overlap_reference=true", bad])


def test_the_binding_reaches_the_engine_processes_and_is_undone(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with pinned_to(CPU, [0, 2]):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,2"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    with pinned_to(CPU, [0, 2]):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_the_plan_decides_each_derived_setting_once(cores):
    """RunPlan: what the trainer and the engine's start read; no overlap without a reference pass,
    even when asked for."""
    from nemo_orchestra.train.run_plan import RunPlan

    cores(4)
    plan = RunPlan.make(load_config(["rollout.steps_ahead=2", "loss.tis_cap=2.0"]), CPU)
    assert (plan.reference_pass, plan.rollouts_ahead, plan.engine_cpus, plan.trainer_threads) == (True, 2, (3, 4), 2)
    assert plan.overlap_reference and plan.live_sequences == 2 * live_sequences(load_config([]))
    plain = RunPlan.make(load_config(["loss.kl_coef=0", "perf.overlap_reference=true"]), CPU)
    assert (plain.reference_pass, plain.rollouts_ahead, plain.engine_cpus, plain.overlap_reference) == (
        False,
        0,
        None,
        False,
    )
