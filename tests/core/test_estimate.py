"""The load-time model (raylazy.core.estimate) and the hardware it reads (raylazy.core.hardware): a plan's figures
against what safetensors and the files say (sizes, shapes, dtypes), the seconds against the hardware's own figures
worked by hand, the bottleneck named, and hardware files validated like options."""

from __future__ import annotations

import json
import os

import pytest
from safetensors import safe_open

from raylazy.core.estimate import compare, estimate, figures, predict
from raylazy.core.hardware import Hardware, hardware_from, parse_hardware, preset, presets
from raylazy.core.planner import with_replicas
from raylazy.errors import ConfigurationError
from raylazy.planning import make_plan
from raylazy.synthetic import write_llama_checkpoint

PAGE = 4096


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("estimate")))


def _files(d: str) -> list[str]:
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))


def _tensor_bytes(d: str) -> dict[str, int]:
    """Every tensor's size in bytes as safetensors reads it (shape x dtype's item size)."""
    import torch

    out = {}
    for path in _files(d):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                numel = 1
                for n in t.get_shape():
                    numel *= n
                out[name] = numel * torch.empty(0, dtype=getattr(torch, {"BF16": "bfloat16", "F32": "float32",
                                                                          "F16": "float16"}[t.get_dtype()])).element_size()
    return out


def hw(**changes) -> Hardware:
    """The nvme-node preset with `changes` ({"storage.page_cache": False, ...})."""
    data = preset("nvme-node").model_dump()
    for path, value in changes.items():
        group, key = path.split(".")
        data[group][key] = value
    return hardware_from(data)


def test_every_preset_figure_has_its_source():
    for name, h in presets().items():
        missing = [k for k in h.figures() if not h.source(k)]
        assert not missing, f"preset {name}: no source for {missing}"
        assert h.note


def test_hardware_files_are_validated_and_name_the_bad_figure(tmp_path):
    good = preset("nfs-cloud").model_dump()
    assert parse_hardware(json.dumps(good)) == hardware_from(good)
    yaml = pytest.importorskip("yaml")
    assert parse_hardware(yaml.safe_dump(good)) == hardware_from(good)
    bad = {**good, "storage": {**good["storage"], "bandwidth_bps": -1}}
    with pytest.raises(ConfigurationError, match="bandwidth_bps"):
        hardware_from(bad)
    with pytest.raises(ConfigurationError, match="nic_gbps"):
        hardware_from({**good, "node": {**good["node"], "nic_gbps": 1}})
    with pytest.raises(ConfigurationError, match="no hardware preset 'dgx'"):
        preset("dgx")
    with pytest.raises(ConfigurationError, match="mapping"):
        parse_hardware("[1, 2]")


def test_vllm_reads_every_file_whole_on_every_rank(ckpt):
    plan = make_plan(ckpt, 4)
    sizes = sum(os.path.getsize(p) for p in _files(ckpt))
    shared = figures(plan, hw(), loader="vllm", ranks_per_node=2)
    # a page cache shared by the node: each node reads every page of every file once
    assert [n.storage_bytes for n in shared.nodes] == [sum(-(-os.path.getsize(p) // PAGE) * PAGE
                                                           for p in _files(ckpt))] * 2
    assert [n.copy_bytes for n in shared.nodes] == [(sizes, sizes)] * 2
    alone = figures(plan, hw(**{"storage.page_cache": False}), loader="vllm", ranks_per_node=2)
    assert [n.storage_bytes for n in alone.nodes] == [2 * sizes] * 2


def test_naive_reads_the_whole_tensors_of_its_shards(ckpt):
    plan = make_plan(ckpt, 2)
    whole = _tensor_bytes(ckpt)
    fig = figures(plan, hw(**{"storage.page_cache": False}), loader="naive", ranks_per_node=2)
    expected = tuple(sum(whole[t.name] for t in rp.tensors) for rp in plan.ranks)
    assert fig.nodes[0].copy_bytes == expected
    assert fig.nodes[0].storage_bytes == sum(expected)


def test_raylazy_reads_each_needed_byte_once_a_node(ckpt):
    plan = make_plan(ckpt, 1)
    data = sum(_tensor_bytes(ckpt).values())
    alone = figures(plan, hw(**{"storage.page_cache": False}), backend="ranged")
    assert alone.nodes[0].storage_bytes == data  # tp=1: every tensor whole, once
    # two ranks on a node without a page cache: the exchange reads the node's union once and each rank receives
    # what the other read for it
    fig = figures(make_plan(ckpt, 2), hw(**{"storage.page_cache": False}), ranks_per_node=2)
    n = fig.nodes[0]
    assert n.backend == "exchange"
    assert data <= n.storage_bytes < data + 2 * PAGE * len(_tensor_bytes(ckpt))
    assert 0 < sum(n.received_bytes) < data


def test_replicas_copy_their_shards_over_the_nic(ckpt):
    plan = with_replicas(make_plan(ckpt, 1), 2)
    data = sum(_tensor_bytes(ckpt).values())
    fig = figures(plan, hw(), ranks_per_node=1)
    assert [(n.replica_in, n.replica_out) for n in fig.nodes] == [(0, data), (data, 0)]
    assert fig.nodes[1].storage_bytes == 0
    live = figures(make_plan(ckpt, 1), hw(), live_source=True)
    assert (live.nodes[0].replica_in, live.nodes[0].storage_bytes) == (data, 0)
    copied = predict(live, hw())  # the copy takes the live replica's plan: nothing planned, nothing read
    assert (copied.phases["plan"], copied.phases["read"]) == (0.0, 0.0) and copied.phases["copy"] > 0
    same = figures(plan, hw(), ranks_per_node=2)
    assert same.nodes[0].replica_local == data


def test_seconds_follow_the_hardware(ckpt):
    """One rank reading every file whole (vLLM's loader) is bound by one stream of the storage: its seconds are the
    bytes at that stream's rate, plus the setup, and halving the rate doubles them."""
    plan = make_plan(ckpt, 1)
    h = hw(**{"costs.read_setup_s": 0.0})
    fig = figures(plan, h, loader="vllm")
    nbytes = fig.nodes[0].storage_bytes
    est = predict(fig, h)
    requests = fig.nodes[0].requests
    expected = requests * h.storage.latency_s + nbytes / h.storage.connection_bps
    assert est.phases["read"] == pytest.approx(expected)
    slower = predict(fig, hw(**{"costs.read_setup_s": 0.0, "storage.connection_bps": h.storage.connection_bps / 2,
                                "storage.latency_s": 0.0}))
    assert slower.phases["read"] == pytest.approx(2 * nbytes / h.storage.connection_bps)
    assert est.phases["total"] == pytest.approx(sum(v for k, v in est.phases.items() if k != "total"))


def test_the_bottleneck_is_named(ckpt):
    plan = make_plan(ckpt, 2)
    slow = estimate(plan, hw(**{"storage.bandwidth_bps": 1e6, "storage.connections": 1}), ranks_per_node=2)
    assert slow.bottleneck.startswith("node0: storage bandwidth")
    quick = estimate(plan, hw(), ranks_per_node=2)
    assert quick.bottleneck.startswith("actors starting")
    far = estimate(with_replicas(plan, 2), hw(**{"node.nic_bps": 1e6}), ranks_per_node=2)
    assert "the NIC" in far.bottleneck and far.phases["copy"] > far.phases["read"]
    assert any("no source" not in a and a.startswith("storage.bandwidth_bps") for a in quick.assumptions)


def test_bad_input_is_named(ckpt):
    plan = make_plan(ckpt, 2)
    with pytest.raises(ConfigurationError, match="unknown loader 'fast'"):
        estimate(plan, "nvme-node", loader="fast")
    with pytest.raises(ConfigurationError, match="1 node id"):
        figures(plan, "nvme-node", node_ids=["a"])
    with pytest.raises(ConfigurationError, match="ranks_per_node"):
        figures(plan, "nvme-node", ranks_per_node=-1)


def test_every_loader_is_modelled_alike(ckpt):
    s3 = preset("s3-region")
    plan = make_plan(ckpt, 4, cost_model=s3.storage.cost_model())  # row-split reads gathered where S3 favours it
    ests = compare(plan, s3, ranks_per_node=4)
    assert set(ests) == {"raylazy", "naive", "vllm"}
    # on object storage raylazy's node reads each needed byte once; the others read whole tensors or files per rank
    assert ests["raylazy"].phases["read"] < min(ests["naive"].phases["read"], ests["vllm"].phases["read"])
    assert ests["raylazy"].nodes[0].backend == "exchange"



def test_the_plan_command_prints_the_estimates(ckpt, tmp_path, capsys):
    from raylazy.cli import main

    assert main(["plan", ckpt, "--tp", "4", "--nodes", "2", "--hardware", "nfs-cloud", "--estimate"]) == 0
    out = capsys.readouterr().out
    assert [line.split(" ")[1] for line in out.splitlines() if line.startswith("estimate (")] == ["(raylazy", "(naive",
                                                                                                  "(vllm"]
    assert "bottleneck: " in out and "storage.latency_s = 0.001 (NFSv4.1" in out
    bad = tmp_path / "hw.json"
    bad.write_text(json.dumps({**preset("nfs-cloud").model_dump(), "storage": {"kind": "nfs"}}))
    assert main(["plan", ckpt, "--tp", "2", "--hardware", str(bad), "--estimate"]) == 2
    assert "bandwidth_bps" in capsys.readouterr().err
    assert main(["plan", ckpt, "--tp", "4", "--nodes", "3", "--hardware", "nvme-node", "--estimate"]) == 2
