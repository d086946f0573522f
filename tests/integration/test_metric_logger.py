"""MetricLogger: metrics.jsonl, TensorBoard scalars with the same keys (and the same values), a resumed
run's TensorBoard curve without the steps logged past its checkpoint, W&B offline."""

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_orchestra.config import ConfigError, LoggerConfig, load_config
from nemo_orchestra.train.metric_logger import WANDB_ID_FILE, MetricLogger, summary_line

ROOT = Path(__file__).resolve().parents[2]


def _cfg(**kw) -> LoggerConfig:
    base = dict(
        tensorboard=True, wandb=False, wandb_project="nemo-orchestra-test", wandb_run_name=None, wandb_mode="offline"
    )
    return LoggerConfig(**{**base, **kw})


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _step(i: int) -> dict:
    return {
        "reward/mean": 0.25 * i,
        "loss/kl": 1.0 / i,
        "train/step_skipped": 0,
        "data/task_ids": [f"t{i}", "u"],
        "note": "text",
    }


def test_tensorboard_gets_every_number_of_metrics_jsonl(tmp_path):
    logger = MetricLogger(str(tmp_path), cfg=_cfg())
    for i in (1, 2, 3):
        logger.log(i, _step(i))
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["data/task_ids"] == ["t1", "u"]  # lists stay in metrics.jsonl
    tb = _scalars(tmp_path / "tensorboard")
    assert set(tb) == {"reward/mean", "loss/kl", "train/step_skipped"}
    for key in tb:
        assert tb[key] == [(r["step"], pytest.approx(r[key])) for r in rows]


def test_a_resumed_run_replaces_the_steps_logged_past_its_checkpoint(tmp_path):
    first = MetricLogger(str(tmp_path), cfg=_cfg())
    for i in (1, 2, 3):  # killed after step 3, its checkpoint was at step 1
        first.log(i, {"reward/mean": float(i)})
    first._tb.flush()  # a SIGKILL leaves what was flushed: what log() flushes
    time.sleep(1.1)  # event files sort by their name's timestamp (seconds), as a relaunch's later file does
    resumed = MetricLogger(str(tmp_path), cfg=_cfg())
    resumed.log(2, {"reward/mean": 20.0})
    resumed.log(3, {"reward/mean": 30.0})
    resumed.close()
    first.close()
    assert _scalars(tmp_path / "tensorboard")["reward/mean"] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_tensorboard_off_writes_no_event_files(tmp_path):
    logger = MetricLogger(str(tmp_path), cfg=_cfg(tensorboard=False))
    logger.log(1, _step(1))
    logger.close()
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "tensorboard").exists()


def test_other_ranks_write_nothing(tmp_path):
    logger = MetricLogger(str(tmp_path / "run"), enabled=False, cfg=_cfg(wandb=True))
    logger.log(1, _step(1))
    logger.close()
    assert not (tmp_path / "run").exists()


def test_summary_line_is_compact():
    line = summary_line(
        {
            "reward/mean": 0.41234,
            "reward/outcome": 0.5,
            "rollout/cost_mean": 0.000312345,
            "time/step_s": 12.3456,
            "data/task_ids": ["a"],
        }
    )
    assert line == "reward=0.412 acc=0.5 cost=0.000312 s=12.3"


def test_logger_keys_are_config_keys():
    cfg = load_config(["logger.wandb=true", "logger.wandb_project=p", "logger.wandb_mode=offline"])
    assert (cfg.logger.tensorboard, cfg.logger.wandb, cfg.logger.wandb_project) == (True, True, "p")
    with pytest.raises(ConfigError, match="logger.wandb_mode"):
        load_config(["logger.wandb_mode=sometimes"])


def test_wandb_missing_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match="logger.wandb=true needs the wandb package"):
        MetricLogger(str(tmp_path), cfg=_cfg(wandb=True))


def _wandb_records(path):
    """The records of a W&B run file: a 7-byte header, then LevelDB's log format (32 KiB blocks of
    chunks with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf, out = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        buf = data[pos + 7 : pos + 7 + length] if kind in (1, 2) else buf + data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def test_wandb_offline_logs_the_same_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no `wandb login` either: auto is offline
    run_dir = tmp_path / "my_run"
    logger = MetricLogger(str(run_dir), cfg=_cfg(wandb=True, wandb_mode="auto"), run_config={"seed": 7})
    for i in (1, 2):
        logger.log(i, _step(i))
    logger.close()
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60  # W&B's own process writes the file; its last record is "exit"
    while "exit" not in (kinds := [r.WhichOneof("record_type") for r in _wandb_records(run_file)]):
        assert time.monotonic() < deadline, kinds
        time.sleep(0.2)
    records = _wandb_records(run_file)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name, run.run_id) == (
        "nemo-orchestra-test",
        "my_run",
        (run_dir / WANDB_ID_FILE).read_text(),
    )
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [{k: v for k, v in h.items() if k not in ("_timestamp", "_runtime")} for h in history] == [
        {"_step": i, "reward/mean": 0.25 * i, "loss/kl": 1.0 / i, "train/step_skipped": 0} for i in (1, 2)
    ]


@pytest.mark.slow
def test_wandb_process_ends_with_a_killed_trainer(tmp_path):
    """W&B runs a process of its own; a trainer killed by SIGKILL must not leave it behind."""
    pytest.importorskip("wandb")
    psutil = pytest.importorskip("psutil")
    code = (
        "import sys, time\nfrom nemo_orchestra.config import LoggerConfig\n"
        "from nemo_orchestra.train.metric_logger import MetricLogger\n"
        "cfg = LoggerConfig(tensorboard=True, wandb=True, wandb_project='p', wandb_run_name=None, wandb_mode='offline')\n"
        "MetricLogger(sys.argv[1], cfg=cfg).log(1, {'reward/mean': 1.0})\nprint('logged', flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "logged"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # wandb-core
    finally:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
