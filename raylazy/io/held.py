"""A checkpoint's files held in memory as chunks cut between tensors (a holder's, `raylazy.cluster.holder`):
`chunk_spans` says where a file is cut, `Held` serves the chunks to the readers as a `Source` per file (read into
their buffers as from storage) and as views of a region's box (`box`, for a copy straight out of them)."""

from __future__ import annotations

import warnings
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np
import torch

from ..core.boxes import Region
from ..core.header import FileHeader
from ..storage import Source
from .mapping import mapped_box

#: A chunk's usual largest size (a tensor larger than it is a chunk of its own).
CHUNK_BYTES = 64 << 20
#: Chunks start at multiples of it: a view of a tensor in its chunk is aligned as it is in the file.
_ALIGN = 64


def chunk_spans(header: FileHeader, max_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """The [start, end) spans a file is held in, covering it from its first byte (the header) to its last: each
    ends where a tensor ends, at a multiple of 64 (so no tensor is cut), and is at most `max_bytes` unless one
    tensor alone is larger."""
    cuts = [t.end for t in header.tensors if t.end % _ALIGN == 0 and t.end < header.file_size]
    spans, start, end = [], 0, 0
    for cut in [*cuts, header.file_size]:
        if cut - start > max_bytes and end > start:
            spans.append((start, end))
            start = end
        end = cut
    spans.append((start, header.file_size))
    return spans


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over `array`'s memory, read-only as it may be (a view of Ray's object store: copied out of,
    never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": nothing writes into it
        return torch.from_numpy(array)


class Held:
    """Files held in memory: per file, its chunks as (first byte, uint8 tensor), in order, covering the file."""

    def __init__(self, uris: Sequence[str], chunks: Sequence[Sequence[tuple[int, torch.Tensor]]]):
        self.uris, self.chunks = list(uris), [list(c) for c in chunks]
        self._starts = [[a for a, _ in c] for c in self.chunks]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for c in self.chunks for _, t in c)

    def source(self, file: int) -> HeldSource:
        """File `file` as a Source the readers read as they read storage."""
        return HeldSource(self, file)

    def box(self, region: Region) -> torch.Tensor:
        """The region's box as a view of the chunk that holds its tensor (where `mapping.box_mappable`)."""
        start, chunk = self._chunk(region.file, region.tensor.start)
        return mapped_box(chunk, region, start)

    def _chunk(self, file: int, offset: int) -> tuple[int, torch.Tensor]:
        return self.chunks[file][bisect_right(self._starts[file], offset) - 1]

    def copy(self, file: int, offset: int, out: np.ndarray) -> None:
        """Bytes [offset, offset + len(out)) of file `file` into `out`, across chunks; EOFError past its end."""
        done = 0
        while done < len(out):
            start, chunk = self._chunk(file, offset + done)
            a = offset + done - start
            n = min(len(out) - done, chunk.numel() - a)
            if n <= 0:
                raise EOFError(f"{self.uris[file]}: {len(out)} bytes from {offset} run past the end of the held file")
            out[done : done + n] = chunk.numpy()[a : a + n]
            done += n


class HeldSource(Source):
    """One held file read as storage is read: every read a copy out of its chunks (nothing can stall or fail)."""

    def __init__(self, held: Held, file: int):
        self.held, self.file, self.uri = held, file, held.uris[file]
        self.size = sum(t.numel() for _, t in held.chunks[file])

    def read(self, offset: int, n: int) -> bytes:
        out = np.empty(max(0, min(n, self.size - offset)), dtype=np.uint8)
        self.held.copy(self.file, offset, out)
        return out.tobytes()

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        for buf in buffers:
            out = np.frombuffer(buf, dtype=np.uint8)
            self.held.copy(self.file, offset, out)
            offset += len(out)

    def close(self) -> None:
        """Nothing to release: the chunks belong to the `Held`."""
