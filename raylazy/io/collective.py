"""Moving bytes between the ranks of one node: a torch.distributed process group of raylazy's own (gloo for
CPU tensors, NCCL for CUDA tensors), never the default group, so the application stays free to call
`torch.distributed.init_process_group` in the same processes.

The ranks of a node meet at one address, `host:port`, served by local rank 0 (a TCPStore on a port the OS picks
as it binds it, so nothing can take the port between choosing and using it: `serve_rendezvous`) and handed to
the node's other ranks. Inside Ray the driver asks each node's local rank 0 and passes the answer on (see
`RankMixin.exchange_address`); processes started otherwise (multiprocessing, torchrun) hand it over through a
file (`meet_through`); vLLM's workers gather it with their other facts. Local rank 0 makes its Exchange at the
address it served; a server no Exchange takes is closed (`close_rendezvous`).

Every rank calls `all_to_all` the same number of times, in the same order: each call moves, from every rank
to every rank, a segment of the caller's `send` tensor (sizes `send_sizes`, in local-rank order) into its
`recv` tensor (sizes `recv_sizes`). Zero-sized segments are allowed, so one call can carry one stripe from
every reader to the ranks that keep its bytes. gloo and NCCL both implement it (`alltoall_base`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from datetime import timedelta

from ..errors import ConfigurationError, PeerFailedError, first_line

#: Exchange backends and the device type each moves.
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


#: Rendezvous servers this process started (`serve_rendezvous`) that no Exchange has taken yet, by address.
_SERVED: dict[str, object] = {}


def serve_rendezvous(host: str) -> str:
    """Start serving a node's rendezvous in this process on a port the OS picks as it binds it, and return the
    address (`host:port`); the Exchange this process makes at that address, as local rank 0, uses the server. A
    rank takes part in one load at a time: servers started for earlier loads that never began are closed."""
    import torch.distributed as dist

    _SERVED.clear()
    store = dist.TCPStore(host, 0, None, True, wait_for_workers=False)
    address = f"{host}:{store.port}"
    _SERVED[address] = store
    return address


def close_rendezvous(address: str) -> None:
    """Stop serving the rendezvous at `address` if this process serves it and no Exchange has taken it."""
    _SERVED.pop(address, None)


def meet_through(path: str, local_rank: int, timeout_s: float, host: str = "127.0.0.1") -> str:
    """The node's meeting address for processes that share a file system but no driver: local rank 0 serves the
    rendezvous and writes its address to `path` (atomically); the others wait up to `timeout_s` for the file."""
    if local_rank == 0:
        address = serve_rendezvous(host)
        with open(f"{path}.tmp", "w") as f:
            f.write(address)
        os.replace(f"{path}.tmp", path)
        return address
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise PeerFailedError(f"exchange: local rank {local_rank} waited {timeout_s:g} s for local rank 0 to "
                                  f"name the node's meeting address in {path}; local rank 0 did not start or failed")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


def collective_backend(device: str) -> str:
    """The exchange backend that moves tensors on `device`: gloo on the CPU, NCCL on CUDA."""
    for backend, kind in BACKEND_DEVICE.items():
        if device.split(":")[0] == kind:
            return backend
    raise ConfigurationError(f"no exchange backend moves tensors on device {device!r}: use 'cpu' (gloo) or 'cuda' (NCCL)")


class Exchange:
    """A process group over the `size` ranks of one node; this process is local rank `rank`.

    Local rank 0 serves the rendezvous at `address` ("host:port"); every rank must construct its Exchange
    within `timeout_s` of the others, and every collective call fails after `timeout_s` (a peer that died
    fails it at once, gloo: connection closed). Use as a context manager: leaving it normally waits for every
    rank to finish (a barrier); leaving on an exception aborts the group, so the peers fail instead of waiting.
    """

    def __init__(self, backend: str, rank: int, size: int, address: str, timeout_s: float = 300.0,
                 device: str | None = None):
        """`device`: where the tensors are (default: the backend's device type; NCCL binds this process to it)."""
        import torch.distributed as dist

        if backend not in BACKEND_DEVICE:
            raise ConfigurationError(f"exchange backend {backend!r}: one of {', '.join(BACKEND_DEVICE)}")
        if not 0 <= rank < size:
            raise ConfigurationError(f"exchange: local rank {rank} is not in 0..{size - 1}")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(f"exchange address {address!r} is not host:port (see raylazy.io.collective.serve_rendezvous)")
        self.rank, self.size, self.address, self.timeout_s, self.backend = rank, size, address, timeout_s, backend
        self.device = device or BACKEND_DEVICE[backend]
        timeout = timedelta(seconds=timeout_s)
        self._store = _SERVED.pop(address, None) if rank == 0 else None
        if rank == 0 and self._store is None:
            raise ConfigurationError(
                f"exchange: local rank 0 makes its Exchange at the address it serves, and this process serves none "
                f"at {address}: call raylazy.io.collective.serve_rendezvous in it first")
        try:
            if rank:
                self._store = dist.TCPStore(host, int(port), size, False, timeout=timeout)
            self._store.set_timeout(timeout)
            if backend == "gloo":
                self._pg = dist.ProcessGroupGloo(self._store, rank, size, timeout)
            else:
                import torch

                torch.cuda.set_device(torch.device(self.device))
                # ProcessGroupNCCL takes its timeout only through Options._timeout (gloo's constructor takes one):
                # torch.distributed sets the same attribute in its own _new_process_group_helper, and a group of
                # our own (not init_process_group's default group) has no public road to it.
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self._pg = dist.ProcessGroupNCCL(self._store, rank, size, opts)
        except (RuntimeError, OSError) as e:  # the rendezvous timed out
            raise PeerFailedError(
                f"exchange: local rank {rank} of {size} could not meet the node's other ranks at {address} within "
                f"{timeout_s:g} s ({backend}): {e}; a rank did not start or failed before joining: load again") from None

    def all_to_all(self, recv, send, recv_sizes: Sequence[int], send_sizes: Sequence[int], what: str = "") -> None:
        """Send segment i of `send` (`send_sizes[i]` elements) to local rank i, receive segment j of `recv`
        from local rank j; returns when this rank's part is done (on CUDA: ordered on the current stream)."""
        import torch.distributed as dist

        try:
            self._pg.alltoall_base(recv, send, list(recv_sizes), list(send_sizes), dist.AllToAllOptions()).wait()
        except RuntimeError as e:
            raise PeerFailedError(
                f"exchange{' of ' + what if what else ''}: local rank {self.rank} of {self.size} ({self.backend} at "
                f"{self.address}) failed: {first_line(e)}; another rank of the node failed (its own error "
                f"says why) or did not answer within {self.timeout_s:g} s") from None

    def close(self, ok: bool = True) -> None:
        """Release the group: after a barrier when `ok` (no rank leaves while a peer still needs it), else at once
        (abort), so that peers blocked on this rank fail instead of waiting."""
        import torch

        pg, self._pg = getattr(self, "_pg", None), None
        if pg is None:
            return
        done = False
        try:
            if ok:
                token = torch.ones(1, device=self.device)
                try:
                    pg.allreduce([token]).wait()
                    done = token.item() == self.size  # .item() waits for the device, too
                except RuntimeError as e:
                    raise PeerFailedError(
                        f"exchange: local rank {self.rank} of {self.size} finished, but the node's other ranks did "
                        f"not ({first_line(e)}); another rank failed (its own error says why)") from None
        finally:
            pg.shutdown() if done else pg.abort()
            self._store = None

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(ok=exc_type is None)
