"""`gc_paused`: the cyclic collector off inside and given back as found; what the pause made handed to the oldest
generation only with `promote` and only where a young pass would have scanned more than its threshold of it (the
planning side: tests/core/test_plan_reference.py)."""

from __future__ import annotations

import gc

from raylazy.core.collector import gc_paused


def in_oldest(obj) -> bool:
    return any(o is obj for o in gc.get_objects(generation=2))


def test_a_pause_promotes_only_what_is_asked_and_worth_it(monkeypatch):
    """A pause that made more than a young pass's worth of objects (lists: always tracked) hands them to the oldest
    generation with `promote` (after asking whether the process froze objects of its own) and leaves them young
    without; one that made fewer leaves them young and does not ask, since asking walks every frozen object."""
    real, asked = gc.get_freeze_count, []
    monkeypatch.setattr(gc, "get_freeze_count", lambda: asked.append(1) or real())
    many = 10 * gc.get_threshold()[0]
    for promote, n, promoted in ((True, many, True), (False, many, False), (True, 10, False)):
        asked.clear()
        with gc_paused(promote=promote):
            assert not gc.isenabled()
            made = [[i] for i in range(n)]
        assert gc.isenabled()
        assert in_oldest(made[0]) == promoted and len(asked) == promoted, (promote, n)


def test_a_pause_inside_a_pause_leaves_the_collector_to_the_outer_one():
    """Nested (planning inside a vLLM worker's paused step): the inner pause neither enables nor promotes."""
    with gc_paused(promote=False):
        with gc_paused():
            made = [[i] for i in range(10 * gc.get_threshold()[0])]
        assert not gc.isenabled() and not in_oldest(made[0])
    assert gc.isenabled() and not in_oldest(made[0])
