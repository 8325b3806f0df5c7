"""The one backend decision (`raylazy.core.choices.choose_backend`) and the transport choice, over every case of
their facts: the properties the callers rely on, and the choices docs/vllm.md and docs/network-storage.md state."""

from __future__ import annotations

import itertools

import pytest

from raylazy.core.choices import NODE_BACKENDS, BackendChoice, alone_backend, choose_backend, choose_transport
from raylazy.errors import ConfigurationError

REQUESTED = ("auto", "ranged", "cooperative", "exchange", "fastsafetensors")
CASES = list(itertools.product(REQUESTED, (1, 2, 8), ("cpu", "cuda:0"), (True, False), (None, False, True),
                               (True, False)))


@pytest.mark.parametrize("copies_out", [False, True])
def test_every_choice_is_consistent_with_its_facts(copies_out):
    for requested, peers, device, page_cache, nogds, mappable in CASES:
        c = choose_backend(requested, peers, device, page_cache, nogds, copies_out, mappable)
        case = (requested, peers, device, page_cache, nogds, copies_out, mappable)
        staged = c.backend == "cooperative" and not page_cache  # the node's bytes staged in shared memory
        if not mappable:  # nothing copies out of a mapping that may fail (cooperative keepers read, on the CPU)
            assert c.backend != "cooperative" or staged or not copies_out and requested == "cooperative" \
                and device == "cpu", case
        assert c.with_node == (c.backend in NODE_BACKENDS and not (copies_out and c.backend == "cooperative")), case
        # a page cache to share, or stages for CPU ranks of a node read (the consumer copying out has neither)
        assert not staged or device == "cpu" and c.with_node and not copies_out and requested != "exchange", case
        if requested not in ("auto", *NODE_BACKENDS):
            assert c.backend == requested and not c.with_node, case  # asked for: kept
        if requested == "auto" and peers == 1 and not (copies_out and page_cache and mappable):
            assert c.backend == "ranged", case  # alone on its node: its own ranges
        if c.with_node and copies_out:
            assert peers > 1, case
        assert c.reads_in_place <= (copies_out and requested == "auto" and peers == 1), case
        assert c.nogds == (True if requested == "fastsafetensors" and nogds is None and peers > 1 else nogds), case


def test_a_node_read_the_vllm_format_chooses_is_the_one_its_batches_read():
    """The vLLM format decides once for its node (copying out where it can); where that is a node read it is an
    exchange, and each batch's node read goes through the node-read driver asking for "exchange"
    (`raylazy.io.serving`), which the driver keeps: the same choice."""
    for requested, peers, device, page_cache, nogds, mappable in CASES:
        served = choose_backend(requested, peers, device, page_cache, nogds, True, mappable)
        if served.with_node:
            assert served.backend == "exchange"
            assert choose_backend("exchange", peers, device, page_cache, nogds, mappable=mappable) == served


def test_the_documented_choices():
    # raylazy.load: cooperative through a shared page cache or stages on CPUs, the exchange on GPUs
    assert choose_backend("auto", 4, "cpu", True).backend == "cooperative"
    assert choose_backend("auto", 4, "cuda:0", True).backend == "exchange"
    assert choose_backend("auto", 4, "cpu", False) == BackendChoice("cooperative", True)
    assert choose_backend("cooperative", 4, "cpu", False) == BackendChoice("cooperative", True)
    assert choose_backend("exchange", 4, "cpu", False).backend == "exchange"
    assert choose_backend("auto", 4, "cuda:0", False).backend == "exchange"
    assert choose_backend("auto", 4, "cpu", False, copies_out=True).backend == "exchange"
    # the vLLM format: copies out of the mappings alone (reading whole takes in place) and on a CPU node
    alone = choose_backend("auto", 1, "cuda:0", True, copies_out=True)
    assert (alone.backend, alone.with_node, alone.reads_in_place) == ("cooperative", False, True)
    assert choose_backend("auto", 1, "cpu", False, copies_out=True).backend == "ranged"
    assert choose_backend("exchange", 1, "cpu", True, copies_out=True).backend == "ranged"
    # network storage (a failed read met through a mapping is a SIGBUS): nothing copies out of a mapping
    assert choose_backend("auto", 4, "cpu", True, mappable=False).backend == "ranged"
    assert choose_backend("cooperative", 4, "cpu", True, mappable=False) == BackendChoice("cooperative", True)
    assert choose_backend("cooperative", 4, "cuda:0", True, mappable=False).backend == "exchange"
    assert choose_backend("auto", 1, "cuda:0", True, copies_out=True, mappable=False).backend == "ranged"
    assert choose_backend("cooperative", 4, "cpu", True, copies_out=True, mappable=False).backend == "ranged"
    assert [alone_backend(b) for b in REQUESTED] == ["ranged", "ranged", "ranged", "ranged", "fastsafetensors"]


def test_transports_that_cannot_carry_the_device_are_refused():
    refs = {"cpu": "object_store", "cuda": "cuda_ipc"}
    assert choose_transport("auto", "cpu", refs) == "object_store"
    assert choose_transport("auto", "cuda:1", refs) == "cuda_ipc"
    assert choose_transport("gloo", "cpu", refs) == "gloo"
    with pytest.raises(ConfigurationError, match="'nccl' cannot carry shards on cpu: use 'auto' or one of "
                                                 "object_store, gloo, nixl"):
        choose_transport("nccl", "cpu", refs)
    peers = ("object_store", "nccl", "gloo")
    with pytest.raises(ConfigurationError, match="peer_transport 'nixl' is not one of auto, object_store, nccl, gloo"):
        choose_transport("nixl", "cpu", refs, "peer_transport", peers)
    with pytest.raises(ConfigurationError, match="use 'auto' or one of object_store, nccl$"):
        choose_transport("gloo", "cuda:0", {"cpu": "object_store", "cuda": "nccl"}, "peer_transport", peers)
