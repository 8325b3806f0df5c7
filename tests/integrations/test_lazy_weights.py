"""Lazy weights (raylazy.integrations.lazy, .serving): a consumer's narrows, selects, transposes and copies say which
bytes are read; its copies, replayed, or a second run of it, leave exactly what it would leave with safetensors'
`get_tensor(...)` (the reference: each test writes the expected cut of the full tensor), reading nothing else."""

from __future__ import annotations

import os
import pickle
import shutil
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from raylazy.core.options import ServingOptions, serving_options
from raylazy.errors import CheckpointNotFoundError, ConfigurationError, FileChangedError, PeerFailedError, ReloadError
from raylazy.integrations.lazy import lazy_weights
from raylazy.integrations.recording import Recording, Served, broadcasts_to, wanted
from raylazy.integrations.recording import replay as replay_copies
from raylazy.integrations.reload import weights_for_reload
from raylazy.io.nodes import ProcessGroupNode
from raylazy.io.regions import RegionReader, opened
from raylazy.io.report import fields, summary
from raylazy.io.serving import AtOnce, Serving
from raylazy.io.stats import ServingStats
from raylazy.storage import LocalSource, open_checkpoint, verified
from tests.support import RANK_PROCESSES
from tests.support.checkpoints import build_checkpoint, reference_tensors
from tests.support.lazy import load_lazily as _run
from tests.support.nodes import ThreadNode

COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
ROW = ("o_proj.weight", "down_proj.weight")


def tp_consumer(rank: int, tp: int, dtype: torch.dtype | None = None):
    """A consumer cutting rank `rank`'s slices as tensor-parallel weight loaders do (narrow, slicing, chunk,
    torch.narrow, a box narrowed along two dims), copying each into a tensor of its own (made on the first run, of
    `dtype`: the weight's by default); returns (the consumer, its tensors, the expected cut of each full tensor)."""
    params, cuts = {}, {}

    def consume(weights):
        for name, w in weights:
            if name.endswith(COLUMN):
                n = w.shape[0] // tp
                part, cut = w.narrow(0, rank * n, n), (lambda t, n=n: t.narrow(0, rank * n, n))
            elif name.endswith(ROW):
                n = w.size(1) // tp
                part, cut = w[:, rank * n : (rank + 1) * n], (lambda t, n=n: t[:, rank * n : (rank + 1) * n])
            elif name.endswith("embed_tokens.weight"):  # a box: rows of this rank, then half the columns
                n = len(w) // tp
                part = torch.narrow(w, 0, rank * n, n).narrow(1, 0, w.shape[1] // 2)
                cut = lambda t, n=n: t.narrow(0, rank * n, n).narrow(1, 0, t.shape[1] // 2)  # noqa: E731
            elif name == "lm_head.weight":  # vocab chunks
                part, cut = w.chunk(tp, dim=0)[rank], (lambda t: t.chunk(tp, dim=0)[rank])
            else:
                part, cut = w, (lambda t: t)
            if name not in params:
                params[name] = torch.empty(part.shape, dtype=dtype or part.dtype)
            params[name].copy_(part)
            cuts[name] = cut

    return consume, params, cuts


def moe_consumer(rank: int, tp: int, params: dict):
    """What vLLM's fused-MoE loader does to an expert (FusedMoE.load_weights and _load_w13/_load_w2): a 2-d
    expert unsqueezed and unbound, a 3-d fused tensor transposed, chunked into w1/w3 and unbound; each expert
    narrowed to the rank's part along its shard dim and copied into a narrowed slice of the fused parameter; a
    scalar of each stored into a scale tensor by index."""

    def load(param, expert, e: int, shard: str):
        dim = 1 if shard == "w2" else 0
        n = expert.shape[dim] // tp
        dst = param.data[e]
        if shard != "w2":
            dst = dst.narrow(0, 0 if shard == "w1" else dst.shape[0] // 2, dst.shape[0] // 2)
        dst.copy_(expert.narrow(dim, rank * n, n))
        # a per-tensor scale, as _load_per_tensor_weight_scale stores one: here the expert's first element
        params["scales"][e][("w1", "w3", "w2").index(shard)] = expert[0, 0:1].reshape(())

    def consume(weights):
        for name, w in weights:
            if ".experts." not in name:
                continue
            layer = name.split(".experts.")[0]
            if w.dim() == 3:  # fused: [E, 2I, H] gate_up or [E, H, I] down, as transformers 5 holds them
                if name.endswith("gate_up_proj"):
                    for i, shard in enumerate(("w1", "w3")):
                        for e, ex in enumerate(w.transpose(-1, -2).transpose(-1, -2).chunk(2, dim=1)[i].unbind()):
                            load(params[layer + ".w13"], ex, e, shard)
                else:
                    for e, ex in enumerate(w.unbind(0)):
                        load(params[layer + ".w2"], ex, e, "w2")
            else:  # experts.<e>.w1/w2/w3 (Mixtral)
                e, proj = int(name.split(".experts.")[1].split(".")[0]), name.split(".")[-2]
                param = params[layer + (".w2" if proj == "w2" else ".w13")]
                for ex in w.unsqueeze(0).unbind():
                    load(param, ex, e, proj)

    return consume


@pytest.mark.parametrize("options", [
    dict(),
    dict(batch_bytes=4096, batches_ahead=0, threads=1, backend="ranged"),  # a batch per region or so, none ahead
    dict(backend="cooperative"),  # every region copied out of the files' mappings
    dict(backend="fastsafetensors"),
])
@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize("rank", [0, 1])
def test_regions_read_match_safetensors(llama_dir, rank, replay, options):
    consume, params, cuts = tp_consumer(rank, 2)
    rec, stats = _run(llama_dir, consume, serving_options(options), replay, watch=lambda: params)
    ref = reference_tensors(llama_dir)
    assert rec.replayable and params.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(params[name], cuts[name](t)), name
    needed = sum(p.numel() * p.element_size() for p in params.values())
    assert stats.bytes_needed == needed < sum(t.numel() * t.element_size() for t in ref.values())
    assert stats.unplanned_regions == 0 and not rec.opaque
    backend = options.get("backend", "auto")
    # alone on a local disk, "auto" copies out of the files' mappings, but what a destination takes as it is read
    assert stats.backend == ("cooperative" if backend == "auto" else backend)
    if replay and backend != "fastsafetensors":  # every destination holds its box's bytes in order: read in
        assert stats.in_place_bytes == needed  # place, or copied straight out of the mapping: nothing held
        assert stats.batches == (0 if backend == "cooperative" else 1)
    elif options.get("batch_bytes") == 4096:
        assert stats.batches > 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_ordered_replay_converts_out_of_reused_buffers(llama_dir, dtype, monkeypatch):
    """Destinations of another dtype than the checkpoint's (bf16): nothing is read in place; a replay in batch order
    (the destinations do not overlap) reads every batch into one of batches_ahead + 1 buffers reused from batch to
    batch and converts as it copies, leaving what safetensors' tensors converted with `.to(dtype)` are."""
    consume, params, cuts = tp_consumer(1, 2, dtype)
    buffers, take = set(), Serving.take

    def late(serving, region, **kw):  # each take's copy starts late: the reader has time to reuse a buffer too early
        t = take(serving, region, **kw)
        buffers.add(t.untyped_storage().data_ptr())
        time.sleep(0.01)
        return t

    monkeypatch.setattr(Serving, "take", late)
    rec, stats = _run(llama_dir, consume, serving_options(dict(batch_bytes=4096, batches_ahead=1, backend="ranged")),
                      watch=lambda: params)
    for name, t in reference_tensors(llama_dir).items():
        assert params[name].dtype == dtype and torch.equal(params[name], cuts[name](t).to(dtype)), name
    assert rec.replayable and stats.in_place_bytes == 0 and stats.batches > 10
    assert len(buffers) <= 2


def _gloo_member(rank: int, rendezvous: str, queue) -> None:
    """One of two processes gathering over gloo (`ProcessGroupNode`): rank 0 starts its part (None) and waits for
    it only after 0.5 s of other work, as a worker copying at once does; rank 1 gathers an object too large for a
    slot at once; then both gather a small one, then one whose pickle just fills a slot."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        node = ProcessGroupNode(rank, 2, dist.group.WORLD)
        if rank == 0:
            gathered = node.gather(None)
            time.sleep(0.5)
            first = gathered()
        else:
            first = node.gather(list(range(1000)))()
        small = node.gather(("small", rank))()
        queue.put((rank, first, small, node.gather(_slot_full(rank))()))
    finally:
        dist.destroy_process_group()


def _slot_full(rank: int) -> bytes:
    """Bytes whose pickle is exactly as long as a gathering's slot carries (the test checks the length)."""
    return bytes([rank]) * (ProcessGroupNode.INLINE - len(pickle.dumps(b"")))


def test_a_process_group_gathers_what_each_process_sends(tmp_path):
    """Two processes over gloo, as vLLM's workers gather: one starts its part early and waits late, the other
    sends more than a slot holds (a second all_gather), then both send small objects (one), then objects that
    just fill a slot: each gets every process's object, in rank order."""
    assert all(len(pickle.dumps(_slot_full(r))) == ProcessGroupNode.INLINE for r in (0, 1))
    queue = RANK_PROCESSES.Queue()
    procs = [RANK_PROCESSES.Process(target=_gloo_member, args=(r, str(tmp_path / "rendezvous"), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {rank: rest for rank, *rest in (queue.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in (0, 1):
        assert got[rank] == [[None, list(range(1000))], [("small", 0), ("small", 1)], [_slot_full(0), _slot_full(1)]]


@pytest.mark.parametrize("replay", [True, False])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_a_node_copies_straight_out_of_the_files_mappings(llama_dir, monkeypatch, replay, dtype):
    """Two workers of one node on a local file system (threads here): no read call but the recording's (for the
    op it cannot follow); every region is copied (converted, where the destination's dtype differs) out of the
    file's mapping into its destination, with safetensors' cut of each tensor as the result. A consumer writing into a weight it took
    whole (an op raylazy cannot follow) writes into memory of its own: a later copy of the same region out of the
    mapping is the checkpoint's."""
    reads = []
    real = LocalSource.readinto
    monkeypatch.setattr(LocalSource, "readinto", lambda self, offset, bufs: reads.append(offset) or real(self, offset, bufs))
    group, results = ThreadNode(2), {}

    def worker(rank: int) -> None:
        consume, params, cuts = tp_consumer(rank, 2, dtype)

        def consume_and_scale(weights):
            rest = []
            for name, w in weights:
                if name.endswith("post_attention_layernorm.weight"):
                    again = w.clone()  # memory of its own, as in eager torch (a view would show the change)
                    params[name + ".scaled"] = w.mul_(2)  # read at once, written in place
                    params.setdefault(name, torch.empty(w.shape, dtype=dtype or w.dtype)).copy_(again)
                    cuts[name] = cuts[name + ".scaled"] = lambda t: t
                else:
                    rest.append((name, w))
            consume(rest)

        results[rank] = (params, cuts, *_run(llama_dir, consume_and_scale, replay=replay, group=group.member(rank),
                                             watch=lambda: {k: v for k, v in params.items() if "scaled" not in k}))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ref = reference_tensors(llama_dir)
    for params, cuts, _, stats in results.values():
        for name, p in params.items():
            want = cuts[name](ref[name.removesuffix(".scaled")]).to(dtype or p.dtype)
            assert torch.equal(p, want * 2 if name.endswith(".scaled") else want), name
        needed = sum(p.numel() * p.element_size() // (2 if dtype else 1) for n, p in params.items()
                     if "scaled" not in n)
        assert (stats.backend, stats.node_processes, stats.batches) == ("cooperative", 2, 0)
        assert stats.bytes_needed == stats.in_place_bytes == needed and stats.unplanned_regions == 0
    # read calls: the recording's takes for the op it cannot follow (read alone, at once), and no other
    opaque = [r.tensor.start for *_, rec, _ in results.values() for r in rec.opaque]
    assert len(results) == 2 and opaque and sorted(reads) == sorted(opaque)


def test_strided_regions_in_object_storage_are_fetched_as_the_cost_model_says(s3, llama_dir):
    """Counted by the proxy in front of SeaweedFS: rank 0's cut of a tp=2 checkpoint, its row-parallel weights
    (o_proj, down_proj: half of every row) strided. With max_gap=0 each row is a request of its own (exactly its
    bytes); by default (None) the storage's cost model decides, and for rows this small (a request costs far more
    than the gap's bytes) fetches each strided region as one range with its gaps. The weights equal
    safetensors' either way."""
    uri = s3.upload_dir(llama_dir, "lazy", "llama")
    ref = reference_tensors(llama_dir)
    rows = sum(t.shape[0] for name, t in ref.items() if name.endswith(ROW))
    gets = {}
    for max_gap in (0, None):
        consume, params, cuts = tp_consumer(0, 2)
        s3.reset()
        _run(uri, consume, serving_options(dict(max_gap=max_gap, storage_options=s3.storage_options)),
             watch=lambda params=params: params)
        gets[max_gap] = len(s3.reset().gets("lazy/llama/"))
        assert all(torch.equal(params[name], cuts[name](t)) for name, t in ref.items())
    assert gets[None] < rows <= gets[0], (gets, rows)


@pytest.mark.parametrize("kind, in_memory, hidden, inter", [("mixtral", False, 64, 64), ("vllm-qwen3moe", True, 128, 64)])
@pytest.mark.parametrize("rank", [0, 1])
def test_experts_are_read_as_slices(tmp_path, kind, in_memory, hidden, inter, rank):
    """Mixtral's experts one by one, Qwen3-MoE's fused on disk: each lands in its slice of the fused w13/w2
    parameters as the expert's tp part (tests/support/checkpoints.py: 4 experts, `hidden` and `inter` their sizes), and
    only those parts are read."""
    model = build_checkpoint(kind, tmp_path / kind, in_memory=in_memory)
    ref = reference_tensors(model)
    layers = sorted({n.split(".experts.")[0] for n in ref if ".experts." in n})
    half = inter // 2
    params = {f"{layer}.w13": torch.zeros(4, inter, hidden, dtype=torch.bfloat16) for layer in layers} | \
             {f"{layer}.w2": torch.zeros(4, hidden, half, dtype=torch.bfloat16) for layer in layers} | \
             {"scales": torch.zeros(4, 3, dtype=torch.float32)}
    rec, stats = _run(model, moe_consumer(rank, 2, params), watch=lambda: params)
    assert rec.replayable and not rec.opaque
    mine = slice(rank * half, (rank + 1) * half)
    for layer in layers:
        for e in range(4):
            if in_memory:
                w1, w3 = ref[f"{layer}.experts.gate_up_proj"][e].chunk(2, dim=0)
                down = ref[f"{layer}.experts.down_proj"][e]
            else:
                w1, w3, down = (ref[f"{layer}.experts.{e}.{p}.weight"] for p in ("w1", "w3", "w2"))
            assert torch.equal(params[f"{layer}.w13"][e][:half], w1[mine])
            assert torch.equal(params[f"{layer}.w13"][e][half:], w3[mine])
            assert torch.equal(params[f"{layer}.w2"][e], down[:, mine])
    assert torch.equal(params["scales"][e], torch.stack([w[0, 0] for w in (w1, w3, down)]).float())  # the last layer's
    weights = sum(p.numel() * 2 for name, p in params.items() if name != "scales")
    assert stats.bytes_needed == stats.planned_bytes_read == weights + len(layers) * 4 * 3 * 2


def test_ops_it_cannot_follow_are_read_at_once_and_counted(llama_dir):
    """`.float()` after a narrow follows; `.item()` and arithmetic read the weight as narrowed, at once, and give
    its real bytes to the op; a region only a second run takes is read on its own and counted."""
    runs = []

    def consume(weights):
        runs.append({})
        for name, w in weights:
            if name.endswith("q_proj.weight"):
                runs[-1][name] = w.t().narrow(0, 0, 4).float() * 2  # followed, then arithmetic: read as narrowed
            elif name.endswith("input_layernorm.weight"):
                runs[-1][name] = torch.tensor([w[0:1].item()]) * 1 + w * 0
            elif name.endswith("v_proj.weight") and len(runs) == 2:  # only the second run takes it
                runs[-1][name] = w.narrow(0, 2, 3).float() + 0
    rec, stats = _run(llama_dir, consume, replay=False)
    ref = reference_tensors(llama_dir)
    q = [n for n in ref if n.endswith("q_proj.weight")]
    norm = [n for n in ref if n.endswith("input_layernorm.weight")]
    v = [n for n in ref if n.endswith("v_proj.weight")]
    for run in runs:  # the first run got real bytes too
        for n in q:
            assert torch.equal(run[n], ref[n].t().narrow(0, 0, 4).float() * 2)
        for n in norm:
            assert torch.equal(run[n], ref[n][0:1] * 1 + ref[n] * 0)
    for n in v:
        assert torch.equal(runs[1][n], ref[n].narrow(0, 2, 3).float())
    q_box = next(r for r in rec.opaque if r.tensor.name == q[0])
    assert q_box.sizes == (ref[q[0]].shape[0], 4)  # the columns .t().narrow(0, 0, 4) took: no more
    assert len(rec.opaque) == len(q) + 2 * len(norm)  # q as narrowed; each norm: its first element, and whole
    assert stats.unplanned_regions == len(v) and stats.unplanned_bytes == sum(3 * ref[n].shape[1] * 2 for n in v)


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_a_checkpoint_in_the_page_cache_is_copied_out_at_once(llama_copy, dtype):
    """Every file in the page cache (and the options not saying `warm_copies=false` or a `ranged` backend): the
    consumer's one run copies each region straight out of the files' mappings as it asks (`AtOnce`), converting
    as it copies, and leaves what safetensors' tensors cut would; an op it cannot follow gets a copy of its own,
    which it may write into; each region's takes are counted, and in the reader's stats. Evicted (posix_fadvise
    DONTNEED), the checkpoint is no longer in the page cache."""
    from benchmarks.loaders.pagecache import evict, warm

    ckpt = open_checkpoint(llama_copy)
    files = [f.path for f in ckpt.files]
    warm(files)
    consume, params, cuts = tp_consumer(1, 2, dtype)
    norms = {}

    def consume_and_scale(weights):
        weights = list(weights)
        consume(weights)
        for name, w in weights:
            if name.endswith("input_layernorm.weight"):
                norms[name] = w.narrow(0, 0, 8).mul_(0)  # in place, on a copy of its own: the mapping keeps its bytes

    for asked in ({"warm_copies": False}, {"backend": "ranged"}):  # always recorded
        with RegionReader(ckpt, serving_options(asked)) as reads:
            assert reads.warm() and not reads.copies_at_once()
    with RegionReader(ckpt, ServingOptions()) as reads:
        assert reads.copies_at_once()
        with AtOnce(reads) as run:
            consume_and_scale(lazy_weights(ckpt, Served(run)))
        stats = replace(reads.stats)
        with AtOnce(reads) as again:
            consume(lazy_weights(ckpt, Served(again)))  # the same bytes, after the writes into the op's copies
    assert reads.copied_from == "the checkpoint in the page cache"  # the log line's reason, still known once left
    ref = reference_tensors(llama_copy)
    for name, t in ref.items():
        assert torch.equal(params[name], cuts[name](t).to(params[name].dtype)), name
        assert run.taken[next(r for r in run.taken if r.tensor.name == name and r not in run.opaque)] == 1
    assert all(not n.any() for n in norms.values()) and len(norms) == len(run.opaque)
    assert {r.tensor.name: r.sizes for r in run.opaque} == {n: (8,) for n in norms}
    assert run.in_place == sum(p.numel() * ref[name].element_size() for name, p in params.items())
    assert not again.opaque and again.taken == run.taken - run.opaque
    assert (stats.regions, stats.bytes_needed, stats.in_place_bytes, stats.opaque_regions) == (
        len(run.taken), sum(r.nbytes for r in run.taken), run.in_place, len(norms))
    for f in files:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if evict(files):
        pytest.skip("this file system keeps the files' pages after posix_fadvise(DONTNEED)")
    with RegionReader(ckpt, ServingOptions()) as reads:
        assert not reads.warm() and not reads.copies_at_once()


def test_leaving_the_reader_unmaps_its_files_on_a_thread_that_ends(llama_dir):
    """The files' mappings a reader made are all unmapped once it is left, by a thread of their own (the load goes
    on meanwhile), which then ends: none of them, and no such thread, is left behind."""
    ckpt = open_checkpoint(llama_dir)
    paths = {f.path for f in ckpt.files}

    def left() -> tuple[set[str], list[str]]:
        with open("/proc/self/maps") as f:
            mapped = {line.split()[-1] for line in f} & paths
        return mapped, [t.name for t in threading.enumerate() if t.name == "raylazy-unmap"]

    with RegionReader(ckpt, ServingOptions()) as reads:
        for f in range(len(ckpt.files)):
            reads.mapping(f)
        assert left()[0] == paths
    deadline = time.monotonic() + 10
    while any(left()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert left() == (set(), [])


def test_a_worker_copying_at_once_stands_aside_from_the_nodes_read(llama_dir):
    """Two workers of one node (threads): one copies at once out of the page cache (`AtOnce`), its part in the
    load's gathering started before its run and waited for when done; the other records and plans its read
    without it, alone on the node (as a worker with no others).
    Both end with safetensors' cut of every tensor."""
    from benchmarks.loaders.pagecache import warm

    ckpt = open_checkpoint(llama_dir)
    warm([f.path for f in ckpt.files])
    group, results = ThreadNode(2), {}

    def worker(rank: int) -> None:
        consume, params, cuts = tp_consumer(rank, 2)
        if rank == 0:
            with RegionReader(ckpt, ServingOptions()) as reads, AtOnce(reads, group.member(rank)) as run:
                assert reads.copies_at_once()
                consume(lazy_weights(ckpt, Served(run)))
            results[rank] = params, cuts, reads.stats
        else:
            results[rank] = params, cuts, _run(llama_dir, consume, group=group.member(rank), watch=lambda: params)[1]

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(2)]  # none left waiting
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    ref = reference_tensors(llama_dir)
    assert results.keys() == {0, 1}
    for params, cuts, _ in results.values():
        assert params.keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(params[name], cuts[name](t)), name
    # alone on its node, it serves as a worker with no others does: copying out of the files' mappings
    assert results[1][2].node_processes == 1 and results[1][2].backend == "cooperative"


@pytest.mark.parametrize("use, replayable", [("scale", False), ("read", False), ("beside", True)])
def test_a_consumer_that_uses_what_it_copied_is_run_again(llama_dir, use, replayable):
    """A copy's destination scaled in place afterwards, or read into another tensor: replaying the copies alone
    would lose that, so the recording says why it cannot be replayed, and the second run gives the consumer's
    own result. Writing beside a copy's destination (vLLM zeroes its vocabulary padding) still replays."""
    made = {}

    def consume(weights):
        for name, w in weights:
            if name.endswith("embed_tokens.weight"):
                n = w.shape[0]
                p = made.setdefault(name, torch.empty(n + 8, w.shape[1], dtype=w.dtype))
                p[:n].copy_(w)
                if use == "scale":
                    p[:n].mul_(2)
                elif use == "read":
                    made["copy"] = p[:n].clone()
                p[n:].fill_(0)
    rec, _ = _run(llama_dir, consume, watch=lambda: made)
    assert rec.replayable is replayable, rec.why_not_replayable
    full = reference_tensors(llama_dir)["model.embed_tokens.weight"]
    got = made["model.embed_tokens.weight"]
    assert torch.equal(got[: len(full)], full * (2 if use == "scale" else 1)) and not got[len(full):].any()
    if use == "read":
        assert torch.equal(made["copy"], full)


def test_a_copy_into_a_tensor_not_watched_is_run_again(llama_dir):
    """A copy into a temporary (not one of the tensors the caller holds) cannot be replayed."""
    consume, params, cuts = tp_consumer(0, 2)
    rec, _ = _run(llama_dir, consume, watch=lambda: dict(list(params.items())[1:]))
    assert not rec.replayable and "not one of the model's" in rec.why_not_replayable
    ref = reference_tensors(llama_dir)
    assert all(torch.equal(params[n], cuts[n](t)) for n, t in ref.items())


@pytest.mark.parametrize("shape", [(2, 0, 3), (2, 3)])
def test_an_empty_weight_copied_by_index_does_what_eager_torch_does(tmp_path, shape):
    """`dst[i] = w` with a weight of no elements: copied (nothing) where eager torch copies it, into a destination
    of the same empty shape, and refused where eager torch refuses it, into a row of 3."""
    save_file({"empty": torch.empty(0, 3), "rows": torch.ones(2, 3)}, str(tmp_path / "model.safetensors"))
    eager, lazy = torch.zeros(shape), torch.zeros(shape)
    try:
        eager[1] = torch.empty(0, 3)
    except RuntimeError:
        eager = None
    assert (eager is None) == (shape == (2, 3))

    def consume(weights):
        for name, w in weights:
            if name == "empty":
                lazy[1] = w

    if eager is None:
        with pytest.raises(RuntimeError):
            _run(str(tmp_path), consume, watch=lambda: {"dst": lazy})
    else:
        _run(str(tmp_path), consume, watch=lambda: {"dst": lazy})
        assert lazy.shape == eager.shape


def test_each_file_is_checked_once_per_load(llama_dir, monkeypatch):
    """However many batches, a file is opened and its header checked once (the readers share the load's sources)."""
    opened = []
    real = verified.open_verified
    monkeypatch.setattr(verified, "open_verified", lambda ref, *a: opened.append(ref.uri) or real(ref, *a))
    consume, params, _ = tp_consumer(0, 2)
    _, stats = _run(llama_dir, consume, serving_options(dict(batch_bytes=4096, backend="ranged")), replay=False,
                    watch=lambda: params)
    assert stats.batches > 10
    assert sorted(opened) == sorted(set(opened)) and len(opened) == len(open_checkpoint(llama_dir).files)


def test_a_read_failure_reaches_the_take(llama_dir, tmp_path):
    """A file changed between the recording and the reading: the take that waits for it raises the reader's error."""
    model = shutil.copytree(llama_dir, tmp_path / "m")
    ckpt = open_checkpoint(model)
    consume, params, _ = tp_consumer(0, 2)
    with RegionReader(ckpt, ServingOptions()) as reads:
        rec = Recording(reads.read_alone)
        consume(lazy_weights(ckpt, rec))
        (tmp_path / "m" / ckpt.files[0].path.rsplit("/", 1)[1]).write_bytes(b"\0" * 16)
        with pytest.raises(FileChangedError, match="plan again"):
            with Serving(reads, wanted(rec.copies)) as serving:
                replay_copies(serving, rec.copies)


def test_shapes_and_errors_match_torch(llama_dir):
    ckpt = open_checkpoint(llama_dir)
    name, w = next(iter(lazy_weights(ckpt, Recording(lambda r: None))))
    t = torch.empty(tuple(w.shape))
    for bad in (lambda x: x.narrow(0, 0, x.shape[0] + 1), lambda x: x.narrow(5, 0, 1), lambda x: x.select(0, 10 ** 6),
                lambda x: x.unsqueeze(5)):
        with pytest.raises((IndexError, RuntimeError)):
            bad(t)
        with pytest.raises((IndexError, RuntimeError)):
            bad(w)
    for op in (lambda x: x[..., 1:3], lambda x: x[-2:], lambda x: x[3], lambda x: x[None, 1:2], lambda x: x.t(),
               lambda x: x.unsqueeze(0).unbind()[0], lambda x: x.unsqueeze(-1).squeeze(-1).transpose(0, 1)[2:5],
               lambda x: x.reshape(1, *x.shape, 1), lambda x: x[1:2].reshape(-1, x.shape[1]).squeeze(),
               lambda x: x.T.contiguous().permute(1, 0), lambda x: x[None][0:1, 1:3, 2:5],
               lambda x: x.unsqueeze(1).narrow(1, 0, 0), lambda x: x.unsqueeze(0).narrow(0, 0, 0)):
        assert op(w).shape == op(t).shape
        assert (op(w).ndim, op(w).dim(), op(w).numel(), op(w).size()) == (op(t).ndim, op(t).dim(), op(t).numel(),
                                                                          op(t).size())
    assert [p.shape for p in w.split([1, w.shape[0] - 1])] == [p.shape for p in t.split([1, t.shape[0] - 1])]
    assert w.dtype == torch.bfloat16 and w.to(torch.float32).dtype == torch.float32 and w.float().ndim == t.ndim
    assert w.half().float().dtype == torch.float32 and w.float().half().dtype == torch.float16  # a chain's last


@pytest.mark.parametrize("dst, src", [((3,), (1, 3)), ((2, 3), (3,)), ((2, 3), (1, 3)), ((2, 3), (2, 1)),
                                      ((0, 3), (1, 3)), ((1, 3), (0, 3)), ((5,), (0,)), ((2, 3), (3, 2)),
                                      ((4, 1, 3), (2, 3)), ((), ()), ((2,), ()), ((), (1,))])
def test_a_deferred_copy_takes_the_shapes_torchs_copy_takes(dst, src):
    try:
        torch.empty(dst).copy_(torch.empty(src))
        takes = True
    except RuntimeError:
        takes = False
    assert broadcasts_to(src, dst) == takes


@pytest.mark.parametrize("options, named", [
    (dict(threads=0), "threads=0"),
    (dict(batch_bytes="1G"), "batch_bytes='1G'"),
    (dict(bogus=1), "bogus=1"),
    (dict(backend="nvme"), "backend='nvme'"),
    (dict(replay=1), "replay=1"),
])
def test_bad_options_are_named(options, named):
    with pytest.raises(ConfigurationError, match=named.replace("[", r"\[")):
        serving_options(options)


def test_consumer_attributes_read_nothing(llama_dir):
    """vLLM tags weights (`w.shard_id = ...`, on `w.detach()` aliases) and probes attributes with getattr: none
    of that reads or notes anything."""
    reads = []
    recording = Recording(lambda r: reads.append(r) or torch.zeros(r.sizes, dtype=torch.bfloat16))
    name, w = next(iter(lazy_weights(open_checkpoint(llama_dir), recording)))
    alias = w.detach()
    w.shard_id, alias.shard_id = "q", "k"
    assert (w.shard_id, alias.shard_id, getattr(w.narrow(0, 0, 1), "shard_id", None)) == ("q", "k", None)
    assert getattr(w, "weight_loader", None) is None and alias.shape == w.shape and w.is_floating_point()
    assert reads == [] and recording.copies == []
    assert w.abs().shape == w.shape and len(reads) == 1  # a tensor method reads the region


def test_view_is_torch_view(llama_dir):
    """`weight.view(shape)` is the tensor method, as vLLM's Falcon loader calls it (`loaded_weight.view(kv_heads,
    -1, head_dim, hidden)`): a view that only adds dims of size 1 reads nothing; one that regroups the dims reads
    the weight's region there and then (as narrowed, once) and gives the values torch's own view of the tensor
    gives; a dtype view reinterprets the bytes as torch does."""
    ckpt = open_checkpoint(llama_dir)
    ref = reference_tensors(llama_dir)
    with RegionReader(ckpt, ServingOptions()) as reads:
        rec = Recording(reads.read_alone)
        name, w = next((n, w) for n, w in lazy_weights(ckpt, rec) if n.endswith("q_proj.weight"))
        t = ref[name]
        assert w.view(1, *w.shape).shape == (1, *t.shape) and not rec.opaque  # followed: nothing read
        rows = w.narrow(0, 0, 4)
        got = rows.view(2, -1, t.shape[1])
        assert torch.equal(got, t.narrow(0, 0, 4).view(2, -1, t.shape[1]))
        assert [(r.starts, r.sizes) for r in rec.opaque] == [((0, 0), (4, t.shape[1]))]
        assert torch.equal(w.view(torch.int16), t.view(torch.int16))


def test_a_worker_that_cannot_open_the_checkpoint_fails_every_worker_before_any_collective(llama_dir, tmp_path):
    """A load's opening (`raylazy.io.regions.opened`, as the vLLM worker's first load and reload make it):
    worker 1 cannot open the checkpoint (its directory is gone); both learn it in the one gathering before any
    other collective of the load: worker 1 raises its own error, worker 0 the failure it is given, naming worker
    1's cause, at once (neither waits in a collective), worker 0's files closed again."""
    def fds() -> set[str]:
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    before, group, raised, got = fds(), ThreadNode(2), {}, {}

    def worker(rank: int) -> None:
        where = llama_dir if rank == 0 else tmp_path / "gone"
        try:
            got[rank] = opened(lambda: open_checkpoint(where), ServingOptions(), group.member(rank), lambda r: rank,
                               lambda w, why, own: own or PeerFailedError(f"worker {w} failed: {why}"))
        except Exception as e:  # noqa: BLE001  (what each worker raised is the outcome)
            raised[rank] = e

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert time.monotonic() - t0 < 10 and not got
    assert isinstance(raised[1], CheckpointNotFoundError) and raised[1].__cause__ is None
    assert isinstance(raised[0], PeerFailedError) and raised[0].__cause__ is None
    assert str(raised[0]).startswith("worker 1 failed: CheckpointNotFoundError: ") and str(tmp_path / "gone") in str(
        raised[0])
    assert not {f for f in fds() - before if f.startswith(str(llama_dir))}
    # and where every worker opens it, each gets the reader and every worker's answer
    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(2)]
    tmp_path.joinpath("gone").symlink_to(llama_dir)
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert {r: answers for r, (_, answers) in got.items()} == {0: [0, 1], 1: [0, 1]}
    for reads, _ in got.values():
        reads.__exit__(None, None, None)


def test_log_line_numbers_read_back():
    """The worker's log line (what the vLLM tests and benchmarks read): every number `summary` writes, `fields`
    reads back as written, behind the log prefix vLLM puts before it; a line of another kind is None."""
    stats = ServingStats(backend="cooperative", storage="nfs", in_flight=16, request_bytes=1 << 20, node_processes=2,
                      bytes_needed=625920, in_place_bytes=4096,
                      planned_bytes_read=629216, planned_requests=7, batches=3, read_seconds=0.25, opaque_regions=1,
                      opaque_bytes=128, unplanned_regions=2, unplanned_bytes=64)
    line = summary(1, stats, 1251840, 1251840, "rerun", "a copy was read", None, 1.5)
    got = fields(f"(EngineCore pid=7) INFO 01-02 03:04:05 [vllm.py:115] {line}")
    assert got == {"rank": 1, "backend": "cooperative", "storage": "nfs", "in_flight": 16, "request_bytes": 1 << 20,
                   "mode": "rerun", "node_processes": 2, "param_bytes": 1251840, "regions": 0,
                   "bytes_needed": 625920, "in_place_bytes": 4096, "checkpoint_bytes": 1251840,
                   "planned_bytes_read": 629216, "planned_requests": 7, "node_bytes": 0, "received_bytes": 0,
                   "rchar": None, "batches": 3, "opaque_regions": 1, "opaque_bytes": 128, "whole_opaque": 0,
                   "unplanned_regions": 2, "unplanned_bytes": 64, "read_seconds": 0.25, "seconds": 1.5}
    assert "rerun (a copy was read)" in line and fields(summary(0, stats, 1, 1, "replay", "", 12, 0.0))["rchar"] == 12
    assert fields("INFO Loading weights took 0.42 seconds [default_loader.py:1]") is None


def test_a_reload_of_an_engine_another_format_loaded_is_a_clear_error(llama_dir):
    """vLLM's reload on raylazy's format asks what the first load recorded: an engine loaded by another format has
    none, and the reload stops before it opens anything, saying so."""
    config = SimpleNamespace(model=llama_dir, model_weights="", revision=None)
    with pytest.raises(ReloadError, match="not loaded with raylazy's format.*nothing was written"):
        weights_for_reload(torch.nn.Linear(2, 2), config, ServingOptions(), open_checkpoint, None, None)


def test_a_reload_serves_the_new_checkpoint_and_records_afresh_where_a_shape_changed(llama_dir, tmp_path):
    """vLLM's reload on raylazy's format (`weights_for_reload`, outside an engine: no node group), after a first
    load recorded as the vLLM worker records one: a checkpoint of the same tensors (another seed) gives each
    parameter the rank's cut of safetensors' tensor, reusing the first load's regions (the log line: rank 0,
    "reload-reused"), and the engine's record then names that checkpoint; a checkpoint with one tensor a row
    longer, then one a row shorter, is recorded afresh (each region read alone as it is taken), the log line
    naming the tensor and both shapes, and the parameters are still safetensors' cuts, of the new shapes."""
    from raylazy.integrations.reload import KEPT, keep
    from raylazy.integrations.runs import recorded

    def reload(path: str):
        """A reload from `path` into a fresh tp=2 consumer (rank 0); (its parameters, expected cuts, log line)."""
        config.model, lines = path, []
        consume, params, cuts = tp_consumer(0, 2)
        consume(weights_for_reload(model, config, ServingOptions(warm_copies=False),
                                   lambda cfg, _: open_checkpoint(cfg.model), None, SimpleNamespace(info=lines.append)))
        assert len(lines) == 1
        return params, cuts, fields(lines[0]), lines[0]

    def same(params, cuts, path) -> None:
        ref = reference_tensors(path)
        assert params.keys() == ref.keys()
        for name, p in params.items():
            assert torch.equal(p.view(torch.int16), cuts[name](ref[name]).view(torch.int16)), name

    model, config = torch.nn.Linear(2, 2), SimpleNamespace(model=llama_dir, model_weights="", revision=None)
    consume, params, _ = tp_consumer(0, 2)
    with RegionReader(open_checkpoint(llama_dir), ServingOptions()) as reads:
        takes = recorded(consume, lambda: params.values(), reads, ServingOptions(), torch.device("cpu"), None).takes
        keep(model, config, reads.ckpt, takes, sum(p.nbytes for p in params.values()))
    step1 = build_checkpoint("llama", tmp_path / "step1", seed=1)
    got, cuts, line, _ = reload(step1)
    same(got, cuts, step1)
    assert (line["rank"], line["mode"], line["unplanned_regions"]) == (0, "reload-reused", 0)
    kept = getattr(model, KEPT)
    assert kept.source == (step1, "", None) and set(kept.takes) == {(r.tensor.name, r.starts, r.sizes) for r in takes}
    tensors = reference_tensors(step1)
    norm = tensors["model.norm.weight"]
    for n, what in ((len(norm) + 1, "longer"), (len(norm) - 1, "shorter")):
        out = tmp_path / what
        out.mkdir()
        shutil.copy(os.path.join(step1, "config.json"), out)
        save_file(tensors | {"model.norm.weight": torch.arange(n, dtype=norm.dtype)}, str(out / "model.safetensors"))
        got, cuts, line, text = reload(str(out))
        same(got, cuts, str(out))
        assert line["mode"] == "reload-recorded", what
        assert f"recorded afresh: tensor 'model.norm.weight' has shape [{n}], not [{len(norm)}]" in text, what
        tensors = reference_tensors(out)
        norm = tensors["model.norm.weight"]
