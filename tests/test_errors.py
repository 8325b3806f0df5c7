"""raylazy.errors: every error in one family, on the errors page, and intact across pickling (Ray carries them)."""

from __future__ import annotations

import inspect
import os
import pickle

import pytest

from raylazy import errors
from raylazy.errors import (
    HeaderError,
    PartialByteError,
    RaylazyError,
    TensorSizeError,
)
from raylazy.storage import read_header
from tests.support import REPO
from tests.support.headers import build, entry, write


def _all_error_classes():
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, RaylazyError)]


def _instance(cls):
    if issubclass(cls, HeaderError):
        return cls("/models/m/model-00001-of-00002.safetensors", "tensor 'w': shape [3] needs 6 bytes")
    if issubclass(cls, errors.RankFailedError):
        return cls({3: ValueError("boom"), 1: errors.ReadError("short read at byte 12")})
    return cls("/models/m: something about 'w' and 42")


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_errors_pickle_round_trip(cls):
    err = _instance(cls)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
    assert back.args == err.args
    assert isinstance(back, RaylazyError)
    if isinstance(err, HeaderError):
        assert (back.path, back.detail) == (err.path, err.detail)
    if isinstance(err, errors.RankFailedError):
        assert list(back.failures) == [1, 3]
        assert {r: (type(e), str(e)) for r, e in back.failures.items()} == {
            r: (type(e), str(e)) for r, e in err.failures.items()
        }


#: What a caller catches, and for what: every error class sits under exactly one of these.
FAMILIES = (
    errors.CheckpointError,  # the files on disk: the directory, the index, config.json, a header
    errors.ShardingError,  # the rules (and tp) against the checkpoint
    errors.PlanFormatError,  # a saved plan that cannot be read back
    errors.ConfigurationError,  # the options of a call
    errors.PlacementError,  # the cluster cannot host the ranks
    errors.LoadError,  # reading on the ranks, after planning and placement
)


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_every_error_sits_in_one_family(cls):
    families = [f for f in FAMILIES if issubclass(cls, f)]
    if cls in (RaylazyError, PartialByteError):  # the root, and the base shared by a header and a sharding kind
        assert families == []
    else:
        assert len(families) == 1, (cls, families)
    if issubclass(cls, HeaderError):
        assert families == [errors.CheckpointError]


def test_every_error_is_on_the_errors_page():
    """docs/errors.md: its table's "catch" column is exactly the families, and the page names every error."""
    page = open(os.path.join(REPO, "docs", "errors.md")).read()
    table = page[: page.index("\n## ")]  # the families' table and what follows it, before the kinds of HeaderError
    caught = {row.split("|")[1].strip() for row in table.splitlines() if row.startswith("| `")}
    assert caught == {f"`{f.__name__}`" for f in FAMILIES}
    for cls in (PartialByteError, errors.RankFailedError):
        assert f"`{cls.__name__}`" in table, cls.__name__
    missing = [c.__name__ for c in _all_error_classes() if f"`{c.__name__}`" not in page]
    assert not missing, f"error classes docs/errors.md does not name: {missing}"


def test_raised_header_errors_pickle_round_trip(tmp_path):
    blob = build({"w": entry("F32", [2], 0, 6)}, b"x" * 6)
    path = write(tmp_path, blob)
    with pytest.raises(TensorSizeError) as info:
        read_header(path)
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is TensorSizeError and str(back) == str(info.value) and back.path == path


def test_rank_failed_error_keeps_its_context_across_pickling():
    err = errors.RankFailedError({0: ValueError("boom")}, context="plan")
    assert str(err).startswith("plan failed on 1 rank(s):\n  rank 0: ValueError: boom")
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_rank_failed_error_lists_each_cause_once_with_its_ranks():
    """64 ranks failing alike are one line (as Ray Train groups worker errors); causes differing only in numbers
    group too, shown by the lowest rank's message; other causes get lines of their own."""
    same = {r: errors.ReadError(f"/m/a.safetensors: reading tensor 'w' at byte {100 * r}: Input/output error")
            for r in range(64)}
    err = errors.RankFailedError(same)
    assert str(err).splitlines() == [
        "load failed on 64 rank(s):",
        "  ranks 0-63: ReadError: /m/a.safetensors: reading tensor 'w' at byte 0: Input/output error "
        "(the others' differ only in numbers)"]
    mixed = errors.RankFailedError({5: ValueError("boom"), 0: errors.PeerFailedError("peer 3 died"),
                                    1: errors.PeerFailedError("peer 3 died"), 7: ValueError("boom"),
                                    2: errors.PeerFailedError("peer 3 died"), 6: KeyError("x")}, context="reload")
    assert str(mixed).splitlines() == [
        "reload failed on 6 rank(s):",
        "  ranks 0-2: PeerFailedError: peer 3 died",
        "  ranks 5, 7: ValueError: boom",
        "  rank 6: KeyError: 'x'"]
    assert list(mixed.failures) == [0, 1, 2, 5, 6, 7]
