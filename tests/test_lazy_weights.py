"""Lazy weights (raylazy.integrations.lazy): a consumer's narrows and copies say which bytes are read, and the
second run gets exactly safetensors' `get_tensor(...)` cut the same way, reading nothing else."""

from __future__ import annotations

import shutil

import pytest
import torch
from checkpoints import reference_tensors

from raylazy.core.plans import FileRef
from raylazy.errors import ConfigurationError, FileChangedError
from raylazy.integrations.lazy import LazyOptions, Recording, Serving, lazy_options, lazy_weights
from raylazy.storage import open_checkpoint

COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
ROW = ("o_proj.weight", "down_proj.weight")


def tp_consumer(rank: int, tp: int):
    """A consumer cutting rank `rank`'s slices as tensor-parallel weight loaders do (narrow, slicing, chunk,
    torch.narrow, a box narrowed along two dims), copying each into a buffer of its own; returns
    (the buffers, the expected cut of each full tensor)."""
    buffers, cuts = {}, {}

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
            buffers[name] = buf = torch.empty(part.shape, dtype=part.dtype)
            buf.copy_(part)
            cuts[name] = cut

    return consume, buffers, cuts


def _files(ckpt):
    return tuple(map(FileRef.of, ckpt.files))


def _two_runs(model_dir, consumer, options=LazyOptions()):
    ckpt = open_checkpoint(model_dir)
    recording = Recording()
    consumer(lazy_weights(ckpt, recording))
    with Serving(recording, _files(ckpt), options) as serving:
        consumer(lazy_weights(ckpt, serving))
    return recording, serving.stats


@pytest.mark.parametrize("options", [
    dict(),
    dict(batch_bytes=4096, batches_ahead=0, threads=1),  # one batch per region or so, none read ahead
    dict(backend="fastsafetensors"),
])
@pytest.mark.parametrize("rank", [0, 1])
def test_regions_read_match_safetensors(llama_dir, rank, options):
    consume, buffers, cuts = tp_consumer(rank, 2)
    recording, stats = _two_runs(llama_dir, consume, lazy_options(options))
    ref = reference_tensors(llama_dir)
    assert buffers.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(buffers[name], cuts[name](t)), name
    needed = sum(b.numel() * b.element_size() for b in buffers.values())
    assert stats.bytes_needed == needed < sum(t.numel() * t.element_size() for t in ref.values())
    assert stats.unplanned_regions == stats.opaque_regions == 0
    if options.get("backend") != "fastsafetensors":
        # ranged reads exactly the needed bytes, but for the embedding box, read along its rows only
        emb = ref["model.embed_tokens.weight"]
        assert stats.bytes_read == needed + emb.numel() * emb.element_size() // 4
    else:  # fastsafetensors reads every tensor it touches whole
        assert stats.bytes_read >= sum(t.numel() * t.element_size() for t in ref.values())
    if options.get("batch_bytes") == 4096:
        assert stats.batches > 10


def test_ops_it_cannot_follow_read_the_region_and_count(llama_dir):
    """`.t()` before a narrow, `.item()` and arithmetic read the region as it is (whole here), counted as
    opaque; a region the second run takes that the first did not is read on its own and counted."""
    runs = []

    def consume(weights):
        runs.append({})
        for name, w in weights:
            if name.endswith("q_proj.weight"):
                runs[-1][name] = w.t().narrow(0, 0, 4).clone()
            elif name.endswith("input_layernorm.weight"):
                runs[-1][name] = torch.tensor([w[0:1].item()]) * 1 + w * 0  # item of a 1-element narrow, arithmetic
            elif name.endswith("v_proj.weight") and len(runs) == 2:  # only the second run takes it
                runs[-1][name] = w.narrow(0, 2, 3).float()
    recording, stats = _two_runs(llama_dir, consume)
    ref = reference_tensors(llama_dir)
    q = [n for n in ref if n.endswith("q_proj.weight")]
    norm = [n for n in ref if n.endswith("input_layernorm.weight")]
    v = [n for n in ref if n.endswith("v_proj.weight")]
    for n in q:
        assert torch.equal(runs[1][n], ref[n].t().narrow(0, 0, 4))
    for n in norm:
        assert torch.equal(runs[1][n], ref[n][0:1] * 1 + ref[n] * 0)
    for n in v:
        assert torch.equal(runs[1][n], ref[n].narrow(0, 2, 3).float())
    assert stats.opaque_regions == len(q) + 2 * len(norm)  # q whole; each norm: its first element, and whole
    assert stats.whole_opaque == len(q) + len(norm)
    assert stats.unplanned_regions == len(v)
    assert stats.unplanned_bytes == sum(3 * ref[n].shape[1] * 2 for n in v)


def test_a_read_failure_reaches_the_take(llama_dir, tmp_path):
    """A file changed between the runs' planning and the reading: the take that waits for it raises the reader's error."""
    model = shutil.copytree(llama_dir, tmp_path / "m")
    ckpt = open_checkpoint(model)
    recording = Recording()
    consume, _, _ = tp_consumer(0, 2)
    consume(lazy_weights(ckpt, recording))
    (tmp_path / "m" / ckpt.files[0].path.rsplit("/", 1)[1]).write_bytes(b"\0" * 16)
    with pytest.raises(FileChangedError, match="plan again"):
        with Serving(recording, _files(ckpt)) as serving:
            consume(lazy_weights(ckpt, serving))


def test_shape_errors_match_torch(llama_dir):
    ckpt = open_checkpoint(llama_dir)
    name, w = next(iter(lazy_weights(ckpt, Recording())))
    t = torch.empty(tuple(w.shape))
    for bad in (lambda x: x.narrow(0, 0, x.shape[0] + 1), lambda x: x.narrow(5, 0, 1)):
        with pytest.raises((IndexError, RuntimeError)):
            bad(t)
        with pytest.raises((IndexError, RuntimeError)):
            bad(w)
    assert w[..., 1:3].shape == t[..., 1:3].shape and w[-2:].shape == t[-2:].shape
    assert [p.shape for p in w.split([1, w.shape[0] - 1])] == [p.shape for p in t.split([1, t.shape[0] - 1])]
    assert w.dtype == torch.bfloat16 and w.ndim == t.ndim and w.numel() == t.numel()


@pytest.mark.parametrize("options, named", [
    (dict(threads=0), "threads=0"),
    (dict(batch_bytes="1G"), "batch_bytes='1G'"),
    (dict(bogus=1), "bogus=1"),
    (dict(backend="cooperative"), "backend='cooperative'"),
    (dict(backend="nvme"), "backend='nvme'"),
])
def test_bad_options_are_named(options, named):
    with pytest.raises(ConfigurationError, match=named.replace("[", r"\[")):
        lazy_options(options)


def test_consumer_attributes_read_nothing(llama_dir):
    """vLLM tags weights (`w.shard_id = ...`, on `w.detach()` aliases) and probes attributes with getattr: none
    of that reads or notes anything."""
    recording = Recording()
    name, w = next(iter(lazy_weights(open_checkpoint(llama_dir), recording)))
    alias = w.detach()
    w.shard_id, alias.shard_id = "q", "k"
    assert (w.shard_id, alias.shard_id, getattr(w.narrow(0, 0, 1), "shard_id", None)) == ("q", "k", None)
    assert getattr(w, "weight_loader", None) is None and alias.shape == w.shape
    assert recording.takes == {}
    assert w.contiguous().shape == w.shape and len(recording.takes) == 1  # a tensor method reads the region
