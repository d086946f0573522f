"""Run control: the folder lock, stop signals, the save schedule, the record cut-back on resume,
the requeue decision and the early task-file checks (nemo_orchestra/runtime/run_control.py)."""

import json
import logging
import os
import signal
import time
from types import SimpleNamespace

import pytest

from nemo_orchestra.runtime import run_control as rc


# ---- the lock -------------------------------------------------------------------------------------------


def test_a_lock_file_naming_a_dead_pid_without_flock_holder_is_taken_over(tmp_path, caplog):
    (tmp_path / "run.lock").write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 7}))
    with caplog.at_level(logging.WARNING), rc.RunLock(str(tmp_path)):
        pass
    assert f"took over the lock of pid {2**22 + 7}" in caplog.text


# ---- stop signals ----------------------------------------------------------------------------------------


def test_first_signal_in_the_loop_asks_second_drops_outside_stops_at_once():
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        stop = rc.StopSignals(rc.preempt_signal("USR1")).install()
        stop.in_loop = True
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested() and stop.preempted and stop.signum == signal.SIGUSR1
        with pytest.raises(rc.StopNow) as e:  # a second one: the step in flight is dropped
            os.kill(os.getpid(), signal.SIGTERM)
        assert e.value.signum == signal.SIGUSR1  # the first signal names the stop
        outside = rc.StopSignals().install()
        with pytest.raises(rc.StopNow) as e:
            os.kill(os.getpid(), signal.SIGINT)
        assert e.value.signum == signal.SIGINT and not outside.preempted
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_a_signal_inside_a_finalizer_is_delivered_again_after_it(capsys):
    """A signal that interrupts a ``__del__`` (a subprocess object collected while the run ends) would
    raise StopNow where Python swallows it ("Exception ignored in ...", a traceback, and the stop is
    lost): it comes again once the finalizer has returned, and stops the run there."""
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}

    class Collected:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGUSR1)  # arrives while __del__ runs
            time.sleep(0.01)

    try:
        stop = rc.StopSignals(rc.preempt_signal("USR1")).install()
        with pytest.raises(rc.StopNow) as e:
            Collected()  # collected at once: the signal lands inside its __del__
            time.sleep(2.0)  # the signal comes again meanwhile
        assert e.value.signum == signal.SIGUSR1 and stop.preempted
        assert "Exception ignored" not in capsys.readouterr().err
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_in_finalizer_sees_del_and_weakref_finalizers():
    import inspect
    import weakref

    frames = []

    class Obj:
        def __del__(self):
            frames.append(rc.in_finalizer(inspect.currentframe()))

    Obj()
    holder = type("Holder", (), {})()
    weakref.finalize(holder, lambda: frames.append(rc.in_finalizer(inspect.currentframe())))
    del holder
    assert frames == [True, True]
    assert not rc.in_finalizer(inspect.currentframe())


def test_a_signal_after_the_run_ended_is_one_line_and_raises_nothing(caplog):
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        stop = rc.StopSignals(rc.preempt_signal("USR1")).install()
        stop.ended(0)
        with caplog.at_level(logging.WARNING, logger=rc.__name__):
            for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
                os.kill(os.getpid(), s)  # the run's handler would raise StopNow here
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [
            f"{name} received after the run ended (exit code 0): nothing to stop"
            for name in ("SIGUSR1", "SIGTERM", "SIGINT")
        ]
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_the_stop_file_asks_like_the_preempt_signal(tmp_path):
    stop = rc.StopSignals(signal.SIGUSR1, stop_file=str(tmp_path / "stop"))
    assert not stop.requested()
    (tmp_path / "stop").touch()
    assert stop.requested() and stop.preempted


def test_preempt_signal_names():
    assert rc.preempt_signal("SIGUSR1") == rc.preempt_signal("usr1") == signal.SIGUSR1
    assert rc.preempt_signal(None) is None
    with pytest.raises(ValueError, match="run.preempt_signal"):
        rc.preempt_signal("KILL")


def test_requeue_until_max_restarts(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setenv(rc.REQUEUE_FILE_ENV, str(tmp_path / "requeue"))
    monkeypatch.setenv(rc.RESTARTS_ENV, "1")
    assert rc.request_requeue(2) and (tmp_path / "requeue").read_text() == "2\n"
    (tmp_path / "requeue").unlink()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # Slurm's count wins
    assert not rc.request_requeue(2) and not (tmp_path / "requeue").exists()


# ---- the save schedule -----------------------------------------------------------------------------------


def test_save_schedule_by_step_by_time_and_at_the_end(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(rc.time, "monotonic", lambda: now[0])
    s = rc.SaveSchedule(every=0, every_s=60, max_steps=10)
    assert [k for k in range(1, 11) if s.by_step(k)] == [10]
    assert not s.by_time()
    now[0] += 60
    assert s.by_time()
    s.saved(3)
    assert not s.by_time() and s.last_saved == 3
    assert [k for k in range(1, 11) if rc.SaveSchedule(4, 0, 10).by_step(k)] == [4, 8, 10]
    assert not rc.SaveSchedule(0, 0, 10).by_time()
    assert rc.agree([True, False]) == [True, False]  # one process: as given


def test_param_versions_move_with_an_in_place_update_only():
    import torch

    m = torch.nn.Linear(2, 2)
    v = rc.param_versions(m)
    m(torch.ones(1, 2)).sum().backward()
    assert rc.param_versions(m) == v  # forward/backward leave the weights alone
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert rc.param_versions(m) > v


# ---- records ---------------------------------------------------------------------------------------------


def _write(path, steps, torn=False):
    with open(path, "w") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "x": s * 10}) + "\n")
        if torn:
            f.write('{"step": 9, "x"')


def test_records_are_cut_back_to_the_resumed_step(tmp_path):
    _write(tmp_path / "metrics.jsonl", [1, 2, 3, 4, 5, 6, 7], torn=True)
    _write(tmp_path / "samples.jsonl", [1, 1, 2, 2, 3, 3, 4, 4])
    with open(tmp_path / "metrics.jsonl", "a") as logger:  # the logger's handle, opened before the cut
        assert rc.cut_records(str(tmp_path), 5) == {"metrics.jsonl": 3}  # 6, 7 and the torn line
        logger.write(json.dumps({"step": 6, "x": 60}) + "\n")
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert rc.cut_records(str(tmp_path), 2) == {"metrics.jsonl": 4, "samples.jsonl": 4}
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 1, 2, 2]
    assert rc.cut_records(str(tmp_path), 2) == {}


def test_cut_counts_exactly(tmp_path):
    _write(tmp_path / "metrics.jsonl", [1, 2, 3, 4, 5, 6, 7, 6, 7, 8])  # a resume that kept the old lines
    assert rc.cut_records(str(tmp_path), 5) == {"metrics.jsonl": 5}
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_start_afresh_says_what_it_removes(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    (root / "step_00000003").mkdir(parents=True)
    (root / "latest").write_text("step_00000003")
    _write(tmp_path / "metrics.jsonl", [1, 2, 3])
    with caplog.at_level(logging.WARNING):
        rc.start_afresh(str(tmp_path), str(root))
    assert os.listdir(root) == [] and (tmp_path / "metrics.jsonl").read_text() == ""
    assert "run.resume=false" in caplog.text and "step_00000003" in caplog.text and "metrics.jsonl" in caplog.text


# ---- task files, before anything starts --------------------------------------------------------------------


def _cfg(train=None, evalp=None, per_step=2):
    return SimpleNamespace(data=SimpleNamespace(train_path=train, eval_path=evalp, prompts_per_step=per_step))


def _task(i, **drop):
    from nemo_orchestra.data.default_tasks import generate_tasks

    d = json.loads(generate_tasks(3, 1)[i % 3].to_json())
    for k in drop:
        d.pop(k)
    return json.dumps(d)


@pytest.mark.parametrize(
    "content, words",
    [
        ("", "holds no task records"),
        ("\n\n", "holds no task records"),
        ("{not json\n", ":1: not valid JSON"),
        (None, ":2: "),  # a record without its problem: the second line
        (b"\xff\xfe\x00", "not a text file"),
    ],
)
def test_bad_task_files_are_one_line_errors_naming_file_and_line(tmp_path, content, words):
    path = tmp_path / "tasks.jsonl"
    if content is None:
        content = _task(0) + "\n" + _task(1, problem=1) + "\n"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    for cfg, key in ((_cfg(train=str(path)), "data.train_path"), (_cfg(evalp=str(path)), "data.eval_path")):
        with pytest.raises(ValueError) as e:
            rc.check_task_files(cfg)
        assert str(e.value).startswith(key) and words in str(e.value) and "\n" not in str(e.value)


def test_too_few_training_tasks_for_one_step(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(_task(0) + "\n" + _task(1) + "\n")
    rc.check_task_files(_cfg(train=str(path), per_step=2))
    with pytest.raises(ValueError, match=r"holds 2 task\(s\), fewer than one step's data.prompts_per_step=2 x 2"):
        rc.check_task_files(_cfg(train=str(path), per_step=2), dp_size=2)
    with pytest.raises(ValueError, match="no such file"):
        rc.check_task_files(_cfg(evalp=str(tmp_path / "missing.jsonl")))


# ---- an error inside a GRPO step ----------------------------------------------------------------------------


def _trainer_failing(step: int, touch_weights: bool):
    import torch

    from nemo_orchestra.train.trainer import Trainer

    module = torch.nn.Linear(2, 2)
    saved = []

    def grpo_step():
        torch.rand(3)  # the failed step drew random numbers before failing
        if touch_weights:
            with torch.no_grad():
                module.weight.add_(1.0)
        raise RuntimeError("tool service gone")

    fake = SimpleNamespace(
        step=step,
        learner=SimpleNamespace(module=module),
        grpo_step=grpo_step,
        save=lambda root, rng=None: saved.append((root, fake.step, rng)),
    )
    return Trainer.guarded_step.__get__(fake), saved


def test_an_error_before_the_update_saves_the_last_completed_step_with_its_rng():
    import torch

    guarded, saved = _trainer_failing(step=5, touch_weights=False)
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="tool service gone"):
        guarded("ckpts", rc.SaveSchedule(every=0, every_s=0, max_steps=10, last_saved=3))
    assert [(root, step) for root, step, _ in saved] == [("ckpts", 5)]
    assert torch.equal(saved[0][2]["torch"], before)  # the RNG state of the step's start, not of its failure


@pytest.mark.parametrize("touch_weights, last_saved", [(True, 3), (False, 5)])
def test_no_save_after_the_weights_moved_or_when_already_saved(touch_weights, last_saved):
    guarded, saved = _trainer_failing(step=5, touch_weights=touch_weights)
    with pytest.raises(RuntimeError):
        guarded("ckpts", rc.SaveSchedule(every=0, every_s=0, max_steps=10, last_saved=last_saved))
    assert saved == []


@pytest.mark.parametrize(
    "signum, restarts, code",
    [
        (signal.SIGUSR1, "0", rc.REQUEUE_EXIT),  # the preempt signal in the warm start, evaluation or export
        (signal.SIGUSR1, "3", 128 + signal.SIGUSR1),  # run.max_restarts reached
        (signal.SIGTERM, "0", 128 + signal.SIGTERM),  # a plain stop is not requeued
    ],
)
def test_a_signal_outside_a_grpo_step_requeues_only_for_the_preempt_signal(
    tmp_path, monkeypatch, caplog, signum, restarts, code
):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setenv(rc.RESTARTS_ENV, restarts)
    stop = rc.StopSignals(preempt=signal.SIGUSR1)

    def run():
        raise rc.StopNow(signum)

    with caplog.at_level(logging.WARNING):
        assert rc.guarded(run, str(tmp_path / "run"), stop, max_restarts=3) == code
    assert f"stopped by {signal.Signals(signum).name} outside a GRPO step" in caplog.text
    assert ("asking to be requeued" in caplog.text) == (code == rc.REQUEUE_EXIT)
    assert rc.guarded(run, str(tmp_path / "run")) == 128 + signum  # no stop signals given: never requeued


def _checkpoint_of(root, model_cfg, vocab_size=2176, step=2):
    """A sealed checkpoint folder that records ``model_cfg`` (its weights do not matter here)."""
    from nemo_orchestra.megatron import dist_ckpt
    from nemo_orchestra.train.checkpoint import write_manifest

    folder = root / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    dist_ckpt.write_meta(str(folder), model_cfg, vocab_size, step=step)
    write_manifest(str(folder))
    return folder


def test_a_resume_with_another_model_is_refused_naming_the_keys(tmp_path):
    from dataclasses import replace

    from nemo_orchestra.config import load_config

    cfg = load_config([f"run.output_dir={tmp_path}"])
    _checkpoint_of(tmp_path, replace(cfg.model, num_layers=cfg.model.num_layers + 1, rope_theta=1e6))
    ckpt = str(tmp_path / "checkpoints")
    with pytest.raises(ValueError) as e:
        rc.check_resume(cfg, ckpt)
    assert f"model.num_layers={cfg.model.num_layers} (checkpoint: {cfg.model.num_layers + 1})" in str(e.value)
    assert "model.rope_theta" in str(e.value) and "run.resume=false" in str(e.value)
    rc.check_resume(replace(cfg, run=replace(cfg.run, resume=False)), ckpt)  # a fresh start checks nothing
    same = load_config([f"run.output_dir={tmp_path}", f"model.num_layers={cfg.model.num_layers + 1}"])
    with pytest.raises(ValueError, match="model.rope_theta"):
        rc.check_resume(same, ckpt)
    rc.check_resume(load_config([f"model.num_layers={cfg.model.num_layers + 1}", "model.rope_theta=1e6"]), ckpt)
    with pytest.raises(ValueError, match=r"model.vocab_size=4096 \(checkpoint: 2176\)"):
        rc.check_resume(
            load_config(
                [f"model.num_layers={cfg.model.num_layers + 1}", "model.rope_theta=1e6", "model.vocab_size=4096"]
            ),
            ckpt,
        )


def test_the_resume_command_leaves_out_a_fresh_start(monkeypatch):
    """Run with ``run.resume=false``, the line a stopped run prints must not start afresh (which would remove the
    checkpoint it names): it is the same command without that override, which resumes."""
    import sys

    from nemo_orchestra.runtime.run_control import resume_command

    argv = ["python", "recipes/grpo_orchestrator.py", "run.seed=25", "run.output_dir=/r/seed 25", "run.resume=false"]
    monkeypatch.setattr(sys, "orig_argv", argv, raising=False)
    assert resume_command() == "python recipes/grpo_orchestrator.py run.seed=25 'run.output_dir=/r/seed 25'"
    monkeypatch.setattr(sys, "orig_argv", argv[:2] + ["trainer.max_steps=3"], raising=False)
    assert resume_command() == "python recipes/grpo_orchestrator.py trainer.max_steps=3"
