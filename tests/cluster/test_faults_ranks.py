"""A rank's process killed mid-load: Ray restarts it and it reads again, or, without retries, the load fails fast
with one RankFailedError and releases its actors and placement group."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from raylazy.errors import RankFailedError
from tests.support.faults import (
    blocking_loader,
    read_marker,
    when,
)
from tests.support.raytest import (
    assert_no_leaks,
    check_loaded,
    live,
    load_with,
    wait_for,
    where_am_i,
)


def _kill_when_blocked(marker_dir: str, rank: int, out: dict, stop: threading.Event) -> threading.Thread:
    """Once rank `rank` blocks mid-read (its marker exists), SIGKILL its process; `out` gets the marker."""

    def kill(info: dict) -> None:
        out.update(info, killed_at=time.monotonic())
        os.kill(info["pid"], signal.SIGKILL)

    return when(lambda: read_marker(marker_dir, rank), kill, stop)


@pytest.mark.ray
def test_rank_killed_mid_load_is_restarted_and_reloads(llama_dir, ray_local, tmp_path):
    import ray

    victim, killed, stop = 1, {}, threading.Event()
    before = live()
    killer = _kill_when_blocked(str(tmp_path), victim, killed, stop)
    try:
        loaded = load_with(blocking_loader(str(tmp_path), {victim}), llama_dir, 2, device="cpu", progress=False, backend="ranged",
                           timeout_s=180)
    finally:
        stop.set()
        killer.join()
    try:
        assert killed.get("pid"), "the victim never blocked mid-load"
        assert 0 < killed["progress"] < loaded.plan.ranks[victim].stats.bytes_needed
        check_loaded(loaded, llama_dir)
        inside = ray.get(loaded.run(where_am_i), timeout=60)
        assert inside[victim]["pid"] != killed["pid"], "the victim's shards should come from its restarted process"
        # After the load, a second death: Ray restarts the actor, which reads its plan again by itself
        # (alone, from Ray's KV), and loaded.ranks shows the new process.
        os.kill(inside[victim]["pid"], signal.SIGKILL)
        wait_for(lambda: loaded.ranks[victim].pid != inside[victim]["pid"], 60, "the restart")
        again = ray.get(loaded.run(where_am_i), timeout=60)
        assert again[victim]["pid"] == loaded.ranks[victim].pid != inside[victim]["pid"]
        assert [r["digest"] for r in again] == [r["digest"] for r in inside]
        check_loaded(loaded, llama_dir)
    finally:
        loaded.release()
    assert_no_leaks(before, "release after a restarted rank")


@pytest.mark.ray
def test_rank_killed_without_retries_fails_fast_and_releases(llama_dir, ray_local, tmp_path):
    victim, killed, stop = 0, {}, threading.Event()
    before = live()
    killer = _kill_when_blocked(str(tmp_path), victim, killed, stop)
    timeout_s = 120
    t0 = time.monotonic()
    try:
        with pytest.raises(RankFailedError) as info:
            load_with(blocking_loader(str(tmp_path), {victim}), llama_dir, 2, device="cpu", progress=False, backend="ranged",
                      max_retries=0, timeout_s=timeout_s)
    finally:
        stop.set()
        killer.join()
    done = time.monotonic()
    assert killed.get("pid"), "the victim never blocked mid-load"
    assert list(info.value.failures) == [victim]
    assert f"rank {victim}: " in str(info.value)
    assert done - t0 < timeout_s
    assert done - killed["killed_at"] < 30, "a dead rank must be reported promptly, not at the timeout"
    assert_no_leaks(before, "a rank killed without retries")


