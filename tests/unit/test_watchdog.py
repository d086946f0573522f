"""The watchdog's verdict: a rank whose heartbeat stops moving for the timeout is named, one that keeps
beating never is, whatever the clocks of the nodes."""

import os
import threading

from nemo_orchestra.runtime.watchdog import Watchdog


def test_a_rank_that_stops_beating_is_named_after_the_timeout(tmp_path):
    ours = Watchdog(str(tmp_path), 0, 3, timeout_s=10.0)
    theirs = [Watchdog(str(tmp_path), r, 3, timeout_s=10.0, step=lambda r=r: 4 + r) for r in (1, 2)]
    for w in (ours, *theirs):
        os.makedirs(w.folder, exist_ok=True)
        w.beat()
    assert ours.stalled(now=100.0) is None  # first look: every rank counts from here
    theirs[0].beat()
    theirs[1].beat()
    assert ours.stalled(now=109.0) is None
    theirs[1].beat()  # rank 2 beats on; rank 1 has stopped
    assert ours.stalled(now=112.0) is None  # rank 1 moved at 109
    theirs[1].beat()
    rank, record = ours.stalled(now=119.5)
    assert rank == 1 and record["step"] == 5 and record["beat"] == 2 and "pid" in record and "host" in record


def test_a_rank_never_heard_from_is_named_and_the_line_says_where(tmp_path):
    lines = []
    done = threading.Event()
    w = Watchdog(str(tmp_path), 0, 2, timeout_s=0.3, on_stall=lambda line: (lines.append(line), done.set()))
    w.start()
    assert done.wait(5.0)
    w.stop()
    assert lines[0].startswith("rank 1 (at step ?) has made no progress for 0.3 s (run.stall_timeout_s)")
    assert "resumes from its last checkpoint" in lines[0]
