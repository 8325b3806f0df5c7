"""A driver interrupted (Ctrl-C) while ranks read, while it waits for placement or inside placement-group creation
releases every actor and placement group it made."""

from __future__ import annotations

import _thread
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


def _interrupt_when(predicate, stop: threading.Event, fired: dict) -> threading.Thread:
    """Once predicate() holds, raise KeyboardInterrupt in the main thread; fired["at"] says when."""

    def interrupt(_) -> None:
        fired["at"] = time.monotonic()
        _thread.interrupt_main()

    return when(predicate, interrupt, stop)


@pytest.mark.ray
def test_keyboard_interrupt_while_ranks_read_releases_everything(llama_dir, ray_local, tmp_path):
    before, stop, fired = live(), threading.Event(), {}
    t = _interrupt_when(lambda: read_marker(str(tmp_path), 0), stop, fired)
    try:
        with pytest.raises(KeyboardInterrupt):
            load_with(blocking_loader(str(tmp_path), {0}), llama_dir, 2, device="cpu", progress=False, backend="ranged")
    finally:
        stop.set()
        t.join()
    assert fired, "the interrupt never fired"
    assert time.monotonic() - fired["at"] < 30
    assert_no_leaks(before, "KeyboardInterrupt during reading")


@pytest.mark.ray
@pytest.mark.parametrize("phase", ["creating", "placing"])
def test_keyboard_interrupt_while_waiting_for_placement_releases_everything(llama_dir, ray_local, phase):
    """The group can never be placed (100 CPUs a rank). "creating": interrupt as soon as the group
    exists, which lands while the actors are being created; "placing": once both actors exist, in
    the wait for placement."""
    before, stop, fired = live(), threading.Event(), {}

    def ready():
        pending = "PENDING" in raylazy_groups().values()
        if phase == "creating" or not pending:
            return pending
        return len(live()[0] - before[0]) == 2

    t = _interrupt_when(ready, stop, fired)
    try:
        with pytest.raises(KeyboardInterrupt):
            raylazy.load(llama_dir, 2, device="cpu", progress=False, cpus_per_rank=100, autoscale=True,
                         placement_timeout_s=300)
    finally:
        stop.set()
        t.join()
    assert fired and time.monotonic() - fired["at"] < 30
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
