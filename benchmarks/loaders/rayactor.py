"""raylazy's rank actor with the benchmark's measurements around `load` (imported inside Ray workers)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from raylazy.cluster.actor import RankLoader
from raylazy.io.stats import ReadStats

from .diskstats import Device
from .impls import checksums, measured


@dataclass
class BenchStats(ReadStats):
    """A rank's ReadStats plus the benchmark's measurements of its load (None: the rank sat this load out)."""

    bench: dict | None = None


class BenchRankLoader(RankLoader):
    """RankLoader that records its pid, measures its load, and (per-rank-node runs) may sit a load out.

    Subclassed per load by `configured` with the class attributes below set.
    """

    #: Ranks that read in this load (None: all). The others return empty statistics at once.
    active: frozenset | None = None
    #: Directory where each actor writes a file named after its rank holding its pid.
    pid_dir: str | None = None

    def __init__(self, rank: int, device: str = "auto"):
        if self.pid_dir:  # first, so the sampler watches the process from its start (a tiny load is over in ms)
            with open(os.path.join(self.pid_dir, str(rank)), "w") as fh:
                fh.write(str(os.getpid()))
        super().__init__(rank, device)

    def load(self, plan, options, node_read=None) -> BenchStats:
        if self.active is not None and plan.rank not in self.active:
            return BenchStats(backend=options.backend, device=self.info().device)
        disk = Device([f.uri for f in plan.files])
        stats, m = measured(lambda: RankLoader.load(self, plan, options, node_read), disk if disk.name else None)
        m.update(rank=plan.rank, shard_bytes=sum(t.nbytes for t in plan.tensors), tensors=len(plan.tensors),
                 anon_base=m["anon_before"])  # a fresh actor per load: torch is imported, nothing else held
        return BenchStats(**asdict(stats), bench=m)


def configured(active=None, pid_dir=None) -> type:
    return type("BenchRankLoader", (BenchRankLoader,), {
        "active": None if active is None else frozenset(active), "pid_dir": pid_dir})


def shard_checksums(rank: int, shards: dict) -> dict:
    """For LoadedModel.run: the rank's shard checksums."""
    return checksums(shards)
