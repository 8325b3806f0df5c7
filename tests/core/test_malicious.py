"""Hostile checkpoints: every one is refused with a named RaylazyError, in bounded time and memory.

The corpus covers the header (huge length prefix, a header bomb of millions of tiny
entries, metadata and shape bombs, overlapping offsets, offsets past the file), the
index (traversal paths, non-files, an index that never ends) and symbolic links (to
/etc/passwd, to devices, out of the model directory). Cases that could hang or eat
memory if a guard regressed run in a child process with a memory limit and a timeout,
so a regression fails the test instead of the machine.

Then hypothesis fuzzes `parse_header` and `open_checkpoint` (with a fuzzed index
JSON): both may only succeed or raise RaylazyError subclasses. The number of examples
is 2000 per fuzz test by default; set RAYLAZY_FUZZ_EXAMPLES for longer runs.

No Ray here: everything runs on the driver side (headers and discovery).
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raylazy import errors
from raylazy.core.checkpoint import INDEX_NAME
from raylazy.core.header import MAX_HEADER_BYTES, MAX_HEADER_ITEMS, parse_header
from raylazy.errors import (
    CheckpointNotFoundError,
    DataLayoutError,
    FileSizeMismatchError,
    HeaderError,
    HeaderLengthError,
    IndexFileError,
    MissingShardError,
    RaylazyError,
    UnsafePathError,
)
from raylazy.storage import open_checkpoint, read_header

FUZZ_EXAMPLES = int(os.environ.get("RAYLAZY_FUZZ_EXAMPLES", "2000"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)

#: Loose bounds: the machine may be shared, only runaway cost must fail.
TIME_BOUND_S = 30.0
MEMORY_BOUND_MB = 1500


# --- helpers ---------------------------------------------------------------------


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + data


def valid_file(names=("a", "b")) -> bytes:
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for n in names:
        header[n] = {"dtype": "F32", "shape": [2, 2], "data_offsets": [off, off + 16]}
        off += 16
    return safetensors_bytes(header, bytes(range(off)))


def model_dir(tmp_path, files: dict[str, bytes], index: dict | bytes | None = None, name="model"):
    d = tmp_path / name
    d.mkdir()
    for fname, blob in files.items():
        (d / fname).write_bytes(blob)
    if index is not None:
        (d / INDEX_NAME).write_bytes(index if isinstance(index, bytes) else json.dumps(index).encode())
    return str(d)


def refused(call, exc: type[RaylazyError], *needles: str) -> RaylazyError:
    """call() raises `exc` (a RaylazyError) quickly, and its message names every needle."""
    t0 = time.perf_counter()
    with pytest.raises(exc) as info:
        call()
    assert time.perf_counter() - t0 < TIME_BOUND_S
    for n in needles:
        assert n in str(info.value), f"{n!r} not in {info.value}"
    return info.value


def isolated(code: str, timeout_s: float = 60, memory_mb: int = 3000) -> dict:
    """Run `code` in a child process limited to `memory_mb` of address space and `timeout_s`.

    The code sets `result` (a dict); the child adds the exception type, its message,
    the seconds the code took and the peak RSS it added (MB), and prints them as JSON.
    """
    prelude = textwrap.dedent(
        """
        import json, resource, sys, time
        import raylazy, raylazy.storage
        result = {}
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        try:
        """
    )
    epilogue = textwrap.dedent(
        """
        except BaseException as e:
            result["error"] = type(e).__name__
            result["raylazy"] = isinstance(e, raylazy.RaylazyError)
            result["message"] = str(e)[:500]
        result["seconds"] = time.perf_counter() - t0
        result["peak_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
        print(json.dumps(result))
        """
    )
    script = prelude + textwrap.indent(textwrap.dedent(code).strip() + "\n", "    ") + epilogue

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))

    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout_s,
                          preexec_fn=limit, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- header: length prefix and bombs -------------------------------------------------


@pytest.mark.parametrize("n", [MAX_HEADER_BYTES + 1, 2**40, 2**64 - 1])
def test_huge_header_length_refused_before_reading(tmp_path, n):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", n) + b"{}")
    refused(lambda: read_header(path), HeaderLengthError, str(path), str(n))


def test_header_length_under_cap_but_past_the_file_allocates_nothing(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES) + b"{}")
    r = isolated(f"raylazy.storage.read_header({str(path)!r})")
    assert r["error"] == "HeaderLengthError" and r["peak_mb"] < 50, r


def _bomb_file(path, entries: int, template: bytes) -> int:
    """Write a header of `entries` objects made from `template % i` (bytes), with no data; returns its size."""
    body = b"{" + b",".join([template % i for i in range(entries)]) + b"}"
    assert len(body) <= MAX_HEADER_BYTES
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)))
        f.write(body)
    return len(body)


@pytest.fixture(scope="module")
def tensor_bomb(tmp_path_factory):
    """~1.75 million zero-size tensor entries in a header just under the 100 MB cap: a valid file."""
    path = tmp_path_factory.mktemp("bomb") / "bomb.safetensors"
    n = 1_750_000
    size = _bomb_file(path, n, b'"%x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}')
    return str(path), n, size


def test_header_bomb_of_tiny_tensors_is_refused_in_bounded_time_and_memory(tensor_bomb):
    # Without a cap, parsing such a header took ~47 s and 1.5 GB here; the reader now
    # counts JSON items (',' separators) before parsing and refuses past MAX_HEADER_ITEMS.
    path, n, size = tensor_bomb
    assert size > MAX_HEADER_BYTES * 0.9
    r = isolated(f"raylazy.storage.read_header({path!r})")
    assert r["error"] == "TooManyEntriesError" and r["raylazy"], r
    assert path in r["message"] and str(MAX_HEADER_ITEMS) in r["message"]
    assert r["seconds"] < TIME_BOUND_S, r
    assert r["peak_mb"] < MEMORY_BOUND_MB, r  # a few copies of the 100 MB header at most


def test_header_bomb_through_open_checkpoint(tmp_path, tensor_bomb):
    d = tmp_path / "m"
    d.mkdir()
    os.symlink(tensor_bomb[0], d / "model.safetensors")
    r = isolated(f"raylazy.storage.open_checkpoint({str(d)!r})")
    assert r["error"] == "TooManyEntriesError" and r["seconds"] < TIME_BOUND_S and r["peak_mb"] < MEMORY_BOUND_MB, r


# a million tiny metadata strings; a million dims; ~50 million nested lists with few commas (~50 s, 4.6 GB to parse)
@pytest.mark.parametrize("kind", ["metadata", "shape", "nesting"])
def test_other_bombs_are_refused(tmp_path, kind):
    path = tmp_path / "x.safetensors"
    if kind == "metadata":
        items = b",".join([b'"%x":""' % i for i in range(MAX_HEADER_ITEMS + 10)])
        body = b'{"__metadata__":{' + items + b"}}"
    elif kind == "shape":
        body = b'{"t":{"dtype":"U8","shape":[' + b",".join([b"1"] * (MAX_HEADER_ITEMS + 10)) + b'],"data_offsets":[0,1]}}'
    else:  # each 240-byte unit: 120 lists, one comma
        unit = b"[" * 120 + b"]" * 120
        units = b",".join([unit] * ((MAX_HEADER_BYTES - 100) // (len(unit) + 1)))
        body = b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":[' + units + b"]}}"
        assert body.count(b",") < MAX_HEADER_ITEMS < body.count(b"[") and len(body) <= MAX_HEADER_BYTES
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0")
    r = isolated(f"raylazy.storage.read_header({str(path)!r})")
    assert r["error"] == "TooManyEntriesError" and r["seconds"] < TIME_BOUND_S and r["peak_mb"] < MEMORY_BOUND_MB, r


@pytest.mark.parametrize(
    "number",
    ["0." + "0" * 99_999_800 + "1", "1" + "0" * 99_999_800, "1.7976931348623158" + "0" * 99_999_800 + "e308"],
    ids=["tiny-fraction", "huge-integer", "f64-edge-long-fraction"],
)
def test_a_100_mb_number_is_judged_in_bounded_time_as_safetensors_judges_it(tmp_path, number):
    # The reference refuses numbers out of the f64 range even in keys it ignores; judging one stays cheap.
    body = b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + number.encode() + b"}}"
    blob = struct.pack("<Q", len(body)) + body + b"\0"
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    try:
        safetensors.deserialize(blob)
        accepted = True
    except Exception:  # noqa: BLE001  (any refusal is the reference's verdict)
        accepted = False
    r = isolated(f"result['tensors'] = len(raylazy.storage.read_header({str(path)!r}).tensors)")
    assert r["seconds"] < TIME_BOUND_S and r["peak_mb"] < MEMORY_BOUND_MB, r
    assert ("error" not in r) if accepted else (r["error"] == "HeaderJSONError" and "out of the range" in r["message"]), r


def test_largest_allowed_header_parses_in_bounded_time(tmp_path):
    # Just under the cap: 2**18 - 1 tensors (4 ',' each) is the most one file may hold.
    n = MAX_HEADER_ITEMS // 4
    path = tmp_path / "big.safetensors"
    _bomb_file(path, n, b'"%x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}')
    r = isolated(f"result['tensors'] = len(raylazy.storage.read_header({str(path)!r}).tensors)")
    assert "error" not in r and r["tensors"] == n, r
    assert r["seconds"] < TIME_BOUND_S and r["peak_mb"] < MEMORY_BOUND_MB, r


# --- header: layout ------------------------------------------------------------------


def test_overlapping_offsets(tmp_path):
    header = {"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
              "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}}
    d = model_dir(tmp_path, {"model.safetensors": safetensors_bytes(header, bytes(12))})
    refused(lambda: open_checkpoint(d), DataLayoutError, "model.safetensors", "'b'")


@pytest.mark.parametrize("end", [17, 2**40, 2**60])
def test_offsets_beyond_the_file(tmp_path, end):
    header = {"a": {"dtype": "U8", "shape": [end], "data_offsets": [0, end]}}
    d = model_dir(tmp_path, {"model.safetensors": safetensors_bytes(header, bytes(16))})
    refused(lambda: open_checkpoint(d), FileSizeMismatchError, "model.safetensors", "truncated")


# --- index: traversal and non-files --------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "..", ".", "", "a/b.safetensors",
     "..\\..\\windows.safetensors", "C:\\x.safetensors", "x\x00.safetensors", "/dev/zero"],
)
def test_traversal_paths_in_weight_map(tmp_path, name):
    d = model_dir(tmp_path, {"model-1.safetensors": valid_file()},
                  {"weight_map": {"a": "model-1.safetensors", "b": name}})
    refused(lambda: open_checkpoint(d), UnsafePathError, INDEX_NAME, "'b'")


def test_index_naming_a_missing_shard(tmp_path):
    d = model_dir(tmp_path, {"model-1.safetensors": valid_file()}, {"weight_map": {"a": "model-2.safetensors"}})
    refused(lambda: open_checkpoint(d), MissingShardError, "model-2.safetensors")


def test_index_naming_a_directory_or_fifo_or_device(tmp_path):
    d = model_dir(tmp_path, {"model-1.safetensors": valid_file()},
                  {"weight_map": {"a": "model-1.safetensors", "b": "subdir"}})
    os.mkdir(os.path.join(d, "subdir"))
    refused(lambda: open_checkpoint(d), MissingShardError, "subdir")
    os.rmdir(os.path.join(d, "subdir"))
    os.mkfifo(os.path.join(d, "subdir"))
    refused(lambda: open_checkpoint(d), MissingShardError, "subdir")
    os.unlink(os.path.join(d, "subdir"))
    os.symlink("/dev/zero", os.path.join(d, "subdir"))
    refused(lambda: open_checkpoint(d), MissingShardError, "subdir")


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom", "fifo", "dir"])
def test_index_that_is_not_a_regular_file(tmp_path, target):
    # An index that never ends (a device) or never opens (a FIFO without writer) must not hang
    # or grow memory without bound.
    d = model_dir(tmp_path, {"model-1.safetensors": valid_file()})
    index = os.path.join(d, INDEX_NAME)
    if target == "fifo":
        os.mkfifo(index)
    elif target == "dir":
        os.mkdir(index)
    else:
        os.symlink(target, index)
    r = isolated(f"raylazy.storage.open_checkpoint({d!r})", timeout_s=60, memory_mb=2000)
    assert r["error"] == "IndexFileError" and INDEX_NAME in r["message"], r
    assert r["seconds"] < TIME_BOUND_S and r["peak_mb"] < 500, r


def test_index_larger_than_the_cap(tmp_path):
    from raylazy.core.checkpoint import MAX_JSON_BYTES

    d = model_dir(tmp_path, {"model-1.safetensors": valid_file()})
    with open(os.path.join(d, INDEX_NAME), "wb") as f:
        f.write(b'{"weight_map": {"a": "model-1.safetensors"}, "pad": "')
        f.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk used
    refused(lambda: open_checkpoint(d), IndexFileError, INDEX_NAME, str(MAX_JSON_BYTES))


# --- symbolic links ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["index", "listed", "single", "path"])
def test_symlink_to_etc_passwd_named_as_shard(tmp_path, how):
    files = {} if how in ("single", "path") else {"model-1.safetensors": valid_file()}
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}} if how == "index" else None
    d = model_dir(tmp_path, files, index)
    link = os.path.join(d, "model.safetensors" if how in ("single", "path") else "model-2.safetensors")
    os.symlink("/etc/passwd", link)
    target = link if how == "path" else d
    err = refused(lambda: open_checkpoint(target), HeaderError, link)
    assert isinstance(err, HeaderLengthError)  # "root:x:0" read as a little-endian length


def test_symlink_to_a_device_named_as_shard(tmp_path):
    d = model_dir(tmp_path, {"model-1.safetensors": valid_file()})
    os.symlink("/dev/zero", os.path.join(d, "model-2.safetensors"))  # listdir discovery skips non-files
    ckpt = open_checkpoint(d)
    assert [os.path.basename(f.path) for f in ckpt.files] == ["model-1.safetensors"]
    refused(lambda: open_checkpoint(os.path.join(d, "model-2.safetensors")), CheckpointNotFoundError)


@pytest.mark.parametrize("kind", ["fifo", "dir", "devzero"])
def test_read_header_on_non_regular_files_does_not_block(tmp_path, kind):
    path = str(tmp_path / "x.safetensors")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    else:
        os.symlink("/dev/zero", path)
    r = isolated(f"raylazy.storage.read_header({path!r})", timeout_s=60)
    assert r.get("raylazy") and r["seconds"] < TIME_BOUND_S, r
    assert path in r["message"], r


def test_symlink_policy_follows_links_out_of_the_directory(tmp_path):
    """Policy: links are followed wherever they point (HF cache blobs, shared storage); only names the
    directory lists are opened and each must parse as safetensors. A link to a valid safetensors file
    outside the model directory is therefore accepted."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "weights.bin").write_bytes(valid_file(("c",)))
    d = model_dir(tmp_path, {"model-1.safetensors": valid_file()},
                  {"weight_map": {"a": "model-1.safetensors", "b": "model-1.safetensors", "c": "model-2.safetensors"}})
    os.symlink(elsewhere / "weights.bin", os.path.join(d, "model-2.safetensors"))
    ckpt = open_checkpoint(d)
    assert sorted(t.name for _, t in ckpt.tensors()) == ["a", "b", "c"]


def test_hugging_face_cache_layout_is_accepted(tmp_path):
    repo = tmp_path / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "blobs" / "aaaa").write_bytes(valid_file())
    (repo / "blobs" / "bbbb").write_bytes(json.dumps({"weight_map": {"a": "model.safetensors",
                                                                     "b": "model.safetensors"}}).encode())
    os.symlink("../../blobs/aaaa", snap / "model.safetensors")
    os.symlink("../../blobs/bbbb", snap / INDEX_NAME)
    ckpt = open_checkpoint(snap)
    assert len(ckpt.files) == 1 and sorted(t.name for _, t in ckpt.tensors()) == ["a", "b"]


def test_dangling_symlink_named_by_index(tmp_path):
    d = model_dir(tmp_path, {"model-1.safetensors": valid_file()},
                  {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})
    os.symlink(str(tmp_path / "nowhere"), os.path.join(d, "model-2.safetensors"))
    refused(lambda: open_checkpoint(d), MissingShardError, "model-2.safetensors")


def test_symlink_loop_named_by_index(tmp_path):
    d = model_dir(tmp_path, {"model-1.safetensors": valid_file()},
                  {"weight_map": {"a": "model-1.safetensors", "b": "loop.safetensors"}})
    os.symlink("loop.safetensors", os.path.join(d, "loop.safetensors"))
    refused(lambda: open_checkpoint(d), MissingShardError, "loop.safetensors")


# --- fuzzing ---------------------------------------------------------------------------

_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                          st.text(max_size=12))
_json = st.recursive(_json_scalars, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=4)
_dtypes = st.sampled_from(["F32", "F16", "BF16", "U8", "I64", "F8_E4M3", "F4", "BOOL", "X", ""])
_u64ish = st.one_of(st.integers(0, 64), st.integers(-3, 2**65), st.just(2**64 - 1))


@st.composite
def _headers(draw) -> bytes:
    """A header: mostly well-formed tensor entries with mutations, sometimes junk."""
    entries = {}
    for i in range(draw(st.integers(0, 5))):
        entry = {
            "dtype": draw(_dtypes | _json_scalars),
            "shape": draw(st.lists(_u64ish, max_size=4) | _json_scalars),
            "data_offsets": draw(st.lists(_u64ish, min_size=0, max_size=3) | _json_scalars),
        }
        for k in draw(st.lists(st.sampled_from(["dtype", "shape", "data_offsets"]), max_size=1)):
            entry.pop(k, None)
        entries[draw(st.text(max_size=6)) + str(i)] = entry if draw(st.integers(0, 9)) else draw(_json)
    if draw(st.booleans()):
        entries["__metadata__"] = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3) | _json)
    text = json.dumps(entries, allow_nan=True).encode()
    if draw(st.integers(0, 4)) == 0:  # mutate a byte or truncate
        pos = draw(st.integers(0, max(0, len(text) - 1)))
        text = text[:pos] + draw(st.binary(max_size=3)) + text[pos + 1 :]
    declared = draw(st.one_of(st.just(len(text)), st.integers(0, len(text) + 8), st.integers(0, 2**64 - 1)))
    return struct.pack("<Q", declared) + text + draw(st.binary(max_size=64))


@FUZZ
@given(blob=_headers(), size_delta=st.integers(-16, 16))
def test_fuzz_parse_header_raises_only_raylazy_errors(blob, size_delta):
    try:
        h = parse_header(blob, max(0, len(blob) + size_delta))
    except RaylazyError:
        return
    assert all(t.end <= h.file_size for t in h.tensors)


@FUZZ
@given(blob=st.binary(max_size=200), file_size=st.integers(0, 2**64))
def test_fuzz_parse_header_random_bytes(blob, file_size):
    try:
        parse_header(blob, file_size)
    except RaylazyError:
        pass


_shard_names = st.sampled_from(
    ["model-1.safetensors", "model-2.safetensors", "missing.safetensors", "config.json", INDEX_NAME, "..", ".",
     "../model-1.safetensors", "/etc/passwd", "sub", "sub/x", "", "\x00", "a" * 300, "\udcff.safetensors"]
)


@st.composite
def _indexes(draw) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=80))
    if kind == 1:
        return json.dumps(draw(_json)).encode()
    tensors = st.sampled_from(["a", "b", "c", ""]) | st.text(max_size=5)
    weight_map = draw(st.dictionaries(tensors, _shard_names | _json, max_size=5))
    doc = {"metadata": draw(_json), "weight_map": weight_map if kind > 2 else draw(_json)}
    text = json.dumps(doc, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    if kind == 9:
        pos = draw(st.integers(0, max(0, len(text) - 1)))
        text = text[:pos] + draw(st.binary(max_size=2)) + text[pos + 1 :]
    return text


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzidx")
    (d / "model-1.safetensors").write_bytes(valid_file(("a", "b")))
    (d / "model-2.safetensors").write_bytes(valid_file(("c",)))
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "sub").mkdir()
    return str(d)


@FUZZ
@given(index=_indexes())
def test_fuzz_open_checkpoint_with_a_fuzzed_index(fuzz_dir, index):
    with open(os.path.join(fuzz_dir, INDEX_NAME), "wb") as f:
        f.write(index)
    try:
        ckpt = open_checkpoint(fuzz_dir)
    except RaylazyError:
        return
    for f in ckpt.files:  # whatever is accepted is a real shard of this directory
        assert os.path.dirname(f.path) == fuzz_dir and os.path.basename(f.path).startswith("model-")


def test_every_new_error_is_a_raylazy_error():
    assert issubclass(errors.TooManyEntriesError, HeaderError)
    assert issubclass(IndexFileError, RaylazyError)
