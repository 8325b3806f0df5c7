"""The choices a load makes once, from facts: the backend each rank reads with (`choose_backend`) and the transport
that carries shards (`choose_transport`). Pure: io and the cluster supply the facts and act on the choice; no call
site decides again."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigurationError

#: Backends whose ranks read together with the other ranks of their node.
NODE_BACKENDS = ("cooperative", "exchange")


@dataclass(frozen=True)
class BackendChoice:
    """`backend`: what the rank reads with; `with_node`: whether it reads as part of its node's read (it gets the
    node's `NodeRead`); `reads_in_place`: copying out of the files' mappings, whether the regions a destination
    takes as they are are read straight into it instead; `nogds`: fastsafetensors' nogds."""

    backend: str
    with_node: bool
    reads_in_place: bool = False
    nogds: bool | None = None


def choose_backend(requested: str, peers: int, device: str, page_cache: bool, nogds: bool | None = None,
                   copies_out: bool = False, mappable: bool = True) -> BackendChoice:
    """The backend of a rank asked for `requested`, with `peers` ranks on its node (itself included), loading to
    `device`, its files on storage whose page cache a mapping shares (`page_cache`) or not, and where a copy out of
    a mapping cannot meet a failed read (`mappable`: local storage; on network storage a read failed through a
    mapping is a SIGBUS, which kills the process).

    "auto": a rank alone on its node reads its own ranges ("ranged": they are exactly its pages); ranks sharing a
    node read its union once, through the page cache on the CPU ("cooperative") or with stripes exchanged on a GPU
    ("exchange"). Without a page cache to share (object storage, a FUSE mount serving direct_io) CPU ranks read
    "cooperative" from stages, the node's bytes fetched once into shared memory, and GPU ranks (or consumers copying
    out themselves, or "exchange" asked for) exchange. `copies_out`: the consumer copies out of the files' mappings
    itself (lazy weights): "cooperative" is then those copies, the page cache shared by their page faults, for a
    rank alone too (asked for "auto", reading straight into a destination what it takes whole). fastsafetensors with
    `nogds` None on a shared node gets nogds=True (GDS is for one process per device). Not `mappable`: "auto" reads
    "ranged" where it would copy out of the mappings (each rank's reads through the shared page cache), and the
    consumer that copies out of them itself reads its regions instead ("cooperative" asked for included); asked for,
    "cooperative" keeps its node read on the CPU, its keepers reading their bytes out of the page cache with reads
    (on a GPU, where they would copy out of the mappings, the node exchanges)."""
    nogds = True if requested == "fastsafetensors" and nogds is None and peers > 1 else nogds
    if requested not in ("auto", *NODE_BACKENDS):
        return BackendChoice(requested, False, nogds=nogds)
    if not page_cache:  # on the CPU the node's bytes staged in shared memory, where the consumer does not copy out
        node = "cooperative" if device == "cpu" and requested != "exchange" and not copies_out else "exchange"
    elif device != "cpu" and (requested == "auto" or not mappable):
        node = "exchange"
    elif requested == "auto":
        node = "cooperative" if mappable else ""  # "": no node read, each rank its own ranges
    else:
        node = requested
    if copies_out and page_cache and requested != "exchange" and (peers < 2 or node == "cooperative") and mappable:
        return BackendChoice("cooperative", False, peers < 2 and requested == "auto", nogds)
    if not node or peers < 2 and (requested == "auto" or copies_out) or copies_out and node == "cooperative":
        return BackendChoice("ranged", False, nogds=nogds)
    return BackendChoice(node, True, nogds=nogds)


def maps_safely(storage) -> bool:
    """Whether a copy out of a mapping of files on `storage` (a `StorageKind`, or the hardware's storage of an
    estimate; None: not known) cannot end the process: local storage. A read that network storage fails (a server
    gone, a FUSE daemon's EIO) is a SIGBUS where a mapping meets it, which kills the process, and no handler can
    return from it (docs/network-storage.md)."""
    return storage is None or not storage.network


def alone_backend(requested: str) -> str:
    """What a rank reads with by itself (no node read: a region read at once, a rank whose copy from a live replica
    failed) when `requested` was asked for: "auto" and the node backends read "ranged", the others themselves."""
    return "ranged" if requested == "auto" or requested in NODE_BACKENDS else requested


#: The devices each transport of shards carries.
TRANSPORT_DEVICES = {"object_store": ("cpu", "cuda"), "cuda_ipc": ("cuda",), "nccl": ("cuda",), "gloo": ("cpu",),
                     "nixl": ("cpu", "cuda")}


def choose_transport(option: str, device: str, auto: dict[str, str], name: str = "transport",
                     offered: tuple[str, ...] = tuple(TRANSPORT_DEVICES)) -> str:
    """The transport of shards on `device` for the user's `option` (`name`, one of `offered`): "auto" is
    `auto[kind]` (kind "cpu" or "cuda"); one that cannot carry the device is refused, naming those that can."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if option == "auto":
        return auto[kind]
    if option not in offered:
        raise ConfigurationError(f"{name} {option!r} is not one of auto, {', '.join(offered)}")
    if kind not in TRANSPORT_DEVICES[option]:
        usable = [t for t in offered if kind in TRANSPORT_DEVICES[t]]
        raise ConfigurationError(f"{name} {option!r} cannot carry shards on {device}: use 'auto' or one of "
                                 f"{', '.join(usable)}")
    return option
