"""A driver interrupted (Ctrl-C) while ranks read, while it waits for placement or inside placement-group creation
releases every actor and placement group it made."""

from __future__ import annotations

import _thread
import signal
import threading
import time

import pytest

import raylazy
from tests.support.faults import (
    blocking_loader,
    read_marker,
    when,
)
from tests.support.raytest import (
    assert_no_leaks,
    live,
    load_with,
    raylazy_groups,
)


@pytest.fixture(autouse=True)
def sigint_raises():
    """SIGINT raising KeyboardInterrupt in this process, as in an interactive Python: a test run a shell started in
    the background (`cmd &`) inherits SIGINT ignored, Python then leaves it so, and interrupt_main does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupted(load, predicate) -> float:
    """Run load() while a thread raises KeyboardInterrupt in the main thread once predicate() holds; the seconds
    from the interrupt to load() giving up. A load that ends without one is released (no later test inherits its
    ranks) and fails the test, saying whether the interrupt fired, how SIGINT was handled then (Python ignores
    interrupt_main where it does not handle SIGINT) and what the predicate last raised."""
    stop, seen = threading.Event(), {}

    def polled():
        try:
            return predicate()
        except Exception as e:  # noqa: BLE001  (reported below if the load is not interrupted)
            seen["predicate raised"] = repr(e)
            return False

    def interrupt(_) -> None:
        seen["SIGINT handler"], seen["at"] = signal.getsignal(signal.SIGINT), time.monotonic()
        _thread.interrupt_main()

    t = when(polled, interrupt, stop)
    try:
        loaded = load()
    except KeyboardInterrupt:
        return time.monotonic() - seen["at"]
    except Exception as e:  # noqa: BLE001  (what the interrupt should have pre-empted)
        pytest.fail(f"the load failed without a KeyboardInterrupt ({seen or 'the interrupt never fired'}): {e!r}")
    finally:
        stop.set()
        t.join()
    loaded.release()
    pytest.fail(f"the load ended without a KeyboardInterrupt ({seen or 'the interrupt never fired'})")


@pytest.mark.ray
def test_keyboard_interrupt_while_ranks_read_releases_everything(llama_dir, ray_local, tmp_path):
    before = live()
    after = _interrupted(lambda: load_with(blocking_loader(str(tmp_path), {0}), llama_dir, 2, device="cpu",
                                           progress=False, backend="ranged"),
                         lambda: read_marker(str(tmp_path), 0))
    assert after < 30
    assert_no_leaks(before, "KeyboardInterrupt during reading")


@pytest.mark.ray
@pytest.mark.parametrize("phase", ["creating", "placing"])
def test_keyboard_interrupt_while_waiting_for_placement_releases_everything(llama_dir, ray_local, phase):
    """The group can never be placed (100 CPUs a rank). "creating": interrupt as soon as the group
    exists, which lands while the actors are being created; "placing": once both actors exist, in
    the wait for placement."""
    before = live()

    def ready():
        pending = "PENDING" in raylazy_groups().values()
        if phase == "creating" or not pending:
            return pending
        return len(live()[0] - before[0]) == 2

    after = _interrupted(lambda: raylazy.load(llama_dir, 2, device="cpu", progress=False, cpus_per_rank=100,
                                              autoscale=True, placement_timeout_s=90), ready)
    assert after < 30
    assert_no_leaks(before, "KeyboardInterrupt while waiting for placement")


@pytest.mark.ray
def test_keyboard_interrupt_inside_placement_group_creation_removes_the_group(llama_dir, ray_local, monkeypatch):
    """The narrowest window: the group exists in the GCS but placement_group() has not returned it yet."""
    import importlib

    module = importlib.import_module("ray.util.placement_group")  # the package re-exports a function of that name
    real = module.placement_group

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "placement_group", interrupted)
    before = live()
    with pytest.raises(KeyboardInterrupt):
        raylazy.load(llama_dir, 2, device="cpu", progress=False)
    assert_no_leaks(before, "KeyboardInterrupt inside placement_group()")


@pytest.mark.ray
def test_keyboard_interrupt_inside_an_actors_creation_kills_it(llama_dir, ray_local, monkeypatch):
    """The second rank's actor is registered, then the interrupt lands before its handle is returned; the
    traceback keeps that handle (and so the actor, pending in a group that can never be placed) alive: removing
    the group does not end it, it must be killed."""
    import ray.actor

    real, made = ray.actor.ActorClass._remote, []

    def interrupted(self, *args, **kwargs):
        handle = real(self, *args, **kwargs)
        made.append(handle)
        if len(made) == 2:
            raise KeyboardInterrupt
        return handle

    monkeypatch.setattr(ray.actor.ActorClass, "_remote", interrupted)
    before = live()
    with pytest.raises(KeyboardInterrupt):
        raylazy.load(llama_dir, 2, device="cpu", progress=False, cpus_per_rank=100, autoscale=True)
    assert len(made) == 2
    assert_no_leaks(before, "KeyboardInterrupt inside an actor's creation")
