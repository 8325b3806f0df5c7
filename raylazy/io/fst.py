"""Execute one rank's plan with fastsafetensors' ParallelLoader, then cut the rank's shards.

fastsafetensors reads whole tensors, so this backend reads every tensor the rank
needs in full (only those: a `tensor_filter` keeps the others unread) and builds
each shard from it exactly as the plan says: each piece `(src, dst, length)` along
`shard.dim` copied into the shard's buffer (all of it for a replicated tensor; padding
is zeros). The shard is the caller's tensor (`out`) or a new one, never a view of the
loader's buffers; the full tensor is a borrowed view of the
loader's buffer and is dropped at once, so a rank holds its shards plus the
loader's buffers, never a second full copy. Results are bit-identical to the
ranged backend (sub-byte dtypes come back as uint8 rows, as `typed` says).

Memory: the loader works in batches, and with one process per group (raylazy
always loads `all_local`) a batch is ONE checkpoint file. While a batch is in
flight the loader holds a buffer the size of that file's whole data section
(file size less its header), even when the filter skips most of its tensors
(skipped bytes are allocated but never read). The buffer lives on the target
device: GPU memory when loading to CUDA, host memory on the CPU. `queue_size`
sets how many batches are alive at once:

    -1  serial: load a file, cut its shards, free it, then the next  -> 1 file buffer
     0  one batch in flight: the next file loads while the current one is cut -> 2
     n  n loaded batches queued ahead, plus the one loading and the one being cut -> n + 2

So the staging cost is about (queue_size + 2) x the largest file's data section
(1 x for -1), never more than all the files the rank reads; `ReadStats.staging_bytes`
reports it for the rank's actual files (the sum of that many largest data
sections). Without GDS, loading to a GPU also goes through fastsafetensors' host
bounce buffers (its `bbuf_size_kb`, 16 MiB by default). On top of all that the
rank holds its own shards, as every backend does.

Statistics: bytes_needed is what the shards need (reported to `on_progress` tensor
by tensor); bytes_read and requests are the byte runs fastsafetensors is asked to
read, computed from the plan (`fst_runs`: the rank's whole tensors, merged when at
most FST_MERGE_GAP bytes apart, gaps included), not counted; rchar is measured (its
reads without GDS are read calls of the rank's process; GDS reads are not).

GPUDirect Storage: `options.nogds` True never uses it, False uses it on CUDA, and
None uses it only when the device is CUDA and the rank is alone on its node (the
driver passes True when several ranks share a node); on the CPU GDS is never
used. When fastsafetensors fails because GDS is unusable (cuFile failing to open,
probe, register or read; see `_is_gds_unavailable`), the rank logs one warning and
loads again with nogds=True; later loads in the same process go straight to
nogds. (Where cuFile or /dev/nvidia-fs0 is simply missing, fastsafetensors warns
and falls back on its own: no error reaches us.) Any other error propagates unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Mapping
from functools import partial
from math import prod

from ..core.dtypes import DTYPE_BITS
from ..core.options import ReaderOptions
from ..core.plans import RankPlan, TensorShard
from ..errors import ConfigurationError, GDSUnavailableError, RaylazyError, ReadError
from ..storage import local_path, open_planned_files, read_error, requested
from .buffers import plan_files, shard_buffers, shards_of
from .stats import Counter, Meter, Progress, ReadStats

log = logging.getLogger("raylazy")

#: safetensors dtypes fastsafetensors 0.5 can parse (st_types.DType); others need backend="ranged".
FST_DTYPES = frozenset(
    {"BOOL", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "F16", "F32", "F64", "BF16",
     "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4"}
)

#: Messages of the errors fastsafetensors / its native library raise when cuFile (GDS) cannot be
#: used: driver open (`[FAIL] init_gds()`), support probe, buffer (de)registration, cuFile reads.
#: (When cuFile is simply absent, or /dev/nvidia-fs0 is missing, fastsafetensors itself warns and
#: falls back to its nogds copier; no error reaches us then.)
_GDS_MESSAGES = re.compile(
    r"init_gds|cuFile|cufile|is_gds_supported|register_buffer failed|deregister_buffer failed|"
    r"(?:submit|wait)_gds_read failed|libcufile|nvidia-fs|GPUDirect",
)

#: Tensors at most this many bytes apart are read as one run (fastsafetensors' `select_byte_ranges` default).
FST_MERGE_GAP = 4096

#: Set once GDS failed in this process: later loads use nogds without trying (and warning) again.
_gds_broken = False


def read_rank_fastsafetensors(
    plan: RankPlan,
    device: str,
    *,
    options: ReaderOptions,
    on_progress: Progress | None = None,
    out: Mapping | None = None,
    sources: Mapping | None = None,
) -> tuple[dict, ReadStats]:
    """Read `plan`'s shards onto `device` with fastsafetensors; returns ({name: tensor}, stats).

    `out` ({name: tensor}) gives shards to fill in place and `sources` files checked already, as for
    `raylazy.io.ranged.read_rank_ranged`."""
    import torch

    meter = Meter()
    dev = torch.device(device)
    check_fastsafetensors(plan)
    used = plan_files(plan)
    buffers = shard_buffers(torch, plan, dev, out)
    counter = Counter(on_progress)
    with open_planned_files(plan, used, options.storage_options, sources) as checked:  # the files are the planned ones
        data_bytes = [plan.files[i].size - 8 - int.from_bytes(checked[i].read(0, 8), "little") for i in used]
        load = partial(_load, torch, plan, buffers, dev, {i: checked[i] for i in used}, queue_size=options.queue_size,
                       on_progress=counter.add)
        gds, fallback = _load_falling_back_to_nogds(load, plan.rank, _want_gds(options.nogds, dev), counter)
    depth = min(len(used), max(1, options.queue_size + 2))  # file buffers alive at once
    runs = fst_runs(plan)
    stats = ReadStats(
        backend="fastsafetensors", device=str(dev), bytes_needed=counter.value,
        bytes_read=sum(end - start for _, start, end in runs), requests=len(runs),
        staging_bytes=sum(sorted(data_bytes, reverse=True)[:depth]), staging_buffers=depth, gds=gds,
        gds_fallback=fallback,
    )
    return shards_of(plan, buffers), meter.stop(stats)


def _load_falling_back_to_nogds(load, rank: int, want_gds: bool, counter: Counter) -> tuple[bool, str]:
    """`load(nogds=...)` with GDS when wanted (and not found broken in this process before); if GDS turns out
    unusable, one warning, the attempt's progress taken back, and a load with nogds=True. Returns (GDS used,
    why it was abandoned or "")."""
    global _gds_broken
    gds = want_gds and not _gds_broken
    try:
        load(nogds=not gds)
        return gds, ""
    except Exception as e:
        if not (gds and _is_gds_unavailable(e)):
            raise
        _gds_broken = True
        log.warning("raylazy rank %d: GPUDirect Storage is unavailable on this node (%s: %s); "
                    "loading again with nogds=True", rank, type(e).__name__, str(e).strip()[:200])
        counter.add(-counter.value)  # the failed attempt's shards were discarded
        load(nogds=True)
        return False, f"{type(e).__name__}: {e}"


def check_fastsafetensors(plan: RankPlan) -> None:
    """Raise ConfigurationError unless fastsafetensors can read every tensor and file of `plan` (the driver
    runs this on every rank plan before any actor reads; the reader runs it again for direct callers)."""
    refused = [t for t in plan.tensors if t.reads and not _fst_can_read(t)]
    if refused:
        what = ", ".join(f"{t.name!r} ({t.dtype} {list(t.full_shape)})" for t in refused[:3])
        raise ConfigurationError(
            f"backend='fastsafetensors' cannot read {len(refused)} tensor(s) of rank {plan.rank}: {what}"
            f"{' ...' if len(refused) > 3 else ''}; fastsafetensors supports {', '.join(sorted(FST_DTYPES))} "
            "(F4 only with an even last dim): use backend='ranged'"
        )
    remote = [f.uri for f in plan.files if local_path(f.uri) is None]
    if remote:
        raise ConfigurationError(f"backend='fastsafetensors' reads local files only, not {remote[0]}: "
                                 "use backend='ranged'")


def _fst_can_read(t: TensorShard) -> bool:
    """fastsafetensors parses the dtype, and views F4 as packed pairs (so its last dim must be even)."""
    if t.dtype not in FST_DTYPES:
        return False
    return t.dtype != "F4" or (len(t.full_shape) > 0 and t.full_shape[-1] % 2 == 0)


def _want_gds(nogds: bool | None, dev) -> bool:
    """GDS only to a CUDA device, and only unless nogds is True (None: the driver found us alone on the node)."""
    return dev.type == "cuda" and nogds is not True


def _is_gds_unavailable(exc: BaseException) -> bool:
    """True if `exc` (or its cause) says GPUDirect Storage / cuFile cannot be used, not that a file is bad."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, GDSUnavailableError):
            return True
        if not isinstance(exc, RaylazyError) and _GDS_MESSAGES.search(str(exc)):
            return True
        exc, seen = exc.__cause__, seen + 1
    return False


def fst_runs(plan: RankPlan) -> list[tuple[int, int, int]]:
    """(file, start, end) of the byte runs fastsafetensors reads for `plan`: each needed tensor whole,
    runs at most FST_MERGE_GAP bytes apart merged (as its `select_byte_ranges`)."""
    spans = sorted({(t.file, t.offset, t.offset + prod(t.full_shape) * DTYPE_BITS[t.dtype] // 8)
                    for t in plan.tensors if t.reads})
    runs: list[list[int]] = []
    for f, start, end in spans:
        if runs and runs[-1][0] == f and start - runs[-1][2] <= FST_MERGE_GAP:
            runs[-1][2] = max(runs[-1][2], end)
        else:
            runs.append([f, start, end])
    return [tuple(r) for r in runs]


def _load(torch, plan: RankPlan, buffers: list, dev, sources: dict, *, nogds: bool, queue_size: int,
          on_progress) -> None:
    """Load the tensors with reads (the others are empty, or all padding) out of the files of `sources` and cut each
    into its shard's buffer. Each wait for the next tensor is a request in flight (`raylazy.storage.requested`, on
    the file of the tensor before it): fastsafetensors' own reads are not the load's, but a stall shows there."""
    from fastsafetensors import ParallelLoader, SingleGroup

    by_name = {t.name: (t, flat) for t, (flat, _) in zip(plan.tensors, buffers) if t.reads}
    done: set[str] = set()
    if by_name:
        loader = ParallelLoader(
            SingleGroup(),
            [local_path(s.uri) for s in sources.values()],
            device=str(dev),
            queue_size=queue_size,
            nogds=nogds,
            tensor_filter=lambda name: name in by_name,
            all_local=True,
            use_tqdm_on_load=False,
            # The full tensor is a view of the loader's buffer (no clone); _cut copies the shard out of it.
            borrowed_tensors=True,
            accumulate_resident=False,
        )
        try:
            with contextlib.closing(loader.iterate_weights()) as weights:
                for name, full in _watched(weights, plan, sources):
                    if name not in by_name or name in done:
                        raise ReadError(f"fastsafetensors returned tensor {name!r}, which rank {plan.rank} "
                                        "did not ask for (or returned it twice)")
                    shard, flat = by_name[name]
                    _cut(torch, full, shard, flat)
                    done.add(name)
                    del full  # the borrowed buffer is released when the loader moves to the next file
                    on_progress(shard.bytes_needed)
        finally:
            loader.close()
    missing = [n for n in by_name if n not in done]
    if missing:
        raise ReadError(f"fastsafetensors did not return {len(missing)} planned tensor(s) of rank {plan.rank}, "
                        f"e.g. {missing[:3]}: the checkpoint changed since planning? plan again")


def _watched(weights, plan: RankPlan, sources: dict):
    """fastsafetensors' (name, tensor) pairs, each wait for the next one a request in flight on the file that
    held the tensor before it (the first file, first)."""
    files = {t.name: t.file for t in plan.tensors}
    source, last = next(iter(sources.values())), None
    while True:
        what = f"rank {plan.rank} waiting on fastsafetensors for the tensor after {last!r}"
        with requested(source, what):
            try:
                item = next(weights, None)
            except Exception as e:  # fastsafetensors' own (an I/O error, a file ended early): named, its cause kept
                if isinstance(e, RaylazyError):
                    raise
                raise read_error(source, f"{what} (or a file after it)", f"{type(e).__name__}: {e}") from e
        if item is None:
            return
        yield item
        last = item[0]
        source = sources.get(files.get(last), source)


def _cut(torch, full, shard: TensorShard, flat) -> None:
    """Fill the shard's bytes `flat` from `full`: the plan's reads applied to the tensor's bytes."""
    raw = full.reshape(-1).view(torch.uint8)  # the tensor's bytes as stored (F4: packed pairs)
    if raw.numel() * 8 != prod(shard.full_shape) * DTYPE_BITS[shard.dtype]:
        raise ReadError(f"fastsafetensors returned {raw.numel()} bytes for tensor {shard.name!r}; the plan "
                        f"expects {shard.dtype} {list(shard.full_shape)}: plan again")
    if raw.device != flat.device:
        raw = raw.to(flat.device)
    for r in shard.reads:  # the same byte ranges the ranged backend reads from the file
        src = raw.as_strided((r.count, r.length), (r.stride or r.length, 1),
                             raw.storage_offset() + r.offset - shard.offset)
        flat.as_strided((r.count, r.length), (r.dst_stride or r.length, 1),
                        flat.storage_offset() + r.dst_offset).copy_(src)
    if flat.device.type == "cuda":  # the loader may reuse its buffer once we move on: finish the copy first
        torch.cuda.current_stream(flat.device).synchronize()
