"""``perf.gc_threshold``: the trainer's young-generation GC threshold, set for the run and given back."""

import collections
import gc
from contextlib import ExitStack

import pytest

from nemo_orchestra.config import ConfigError, load_config
from nemo_orchestra.train.build import gc_threshold


def collections_during(work) -> int:
    seen = []

    def count(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(count)
    try:
        work()
    finally:
        gc.callbacks.remove(count)
    return len(seen)


def short_lived_containers():
    """What a rollout's decoding makes: small containers that live a while (a window of the latest
    5,000 rows, about 15,000 containers), then are dropped."""
    window = collections.deque(maxlen=5_000)
    for i in range(50_000):
        window.append([i, [i + 1], {"lp": float(i)}])


def test_the_run_sets_the_young_threshold_and_gives_pythons_back():
    before = gc.get_threshold()
    with ExitStack() as stack:
        gc_threshold(50_000, stack)
        assert gc.get_threshold() == (50_000, *before[1:])
        assert collections_during(short_lived_containers) == 0  # they die before any collection
    assert gc.get_threshold() == before
    assert collections_during(short_lived_containers) > 0  # at Python's 700 they meet collections
    with ExitStack() as stack:
        gc_threshold(None, stack)
        assert gc.get_threshold() == before


def test_the_key_is_checked():
    assert load_config([]).perf.gc_threshold == 50_000
    assert load_config(["perf.gc_threshold=null"]).perf.gc_threshold is None
    with pytest.raises(ConfigError, match="perf.gc_threshold"):
        load_config(["perf.gc_threshold=0"])
