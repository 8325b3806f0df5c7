"""Bytes a rank needs: exactly (the plan's bytes_needed) and page-rounded (the pages its ranges touch).

Page-rounded bytes are the least any reader going through the page cache can pull
from storage for the rank: every 4 KiB page that holds a byte of one of its ranges,
plus the pages of the headers of the files it reads (every loader reads those).
"""

from __future__ import annotations

import os

import numpy as np

from .pagecache import PAGE


def _header_end(path: str) -> int:
    with open(path, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def page_maps(rank_plan) -> dict[str, np.ndarray]:
    """path -> bool array of the file's pages the rank's reads (and the file's header) touch."""
    maps: dict[str, np.ndarray] = {}
    used = sorted({r.file for t in rank_plan.tensors for r in t.reads})
    for i in used:
        ref = rank_plan.files[i]
        pages = (ref.size + PAGE - 1) // PAGE
        diff = np.zeros(pages + 1, dtype=np.int64)
        first = [np.array([0])]
        last = [np.array([(_header_end(ref.uri) - 1) // PAGE])]
        for t in rank_plan.tensors:
            for r in t.reads:
                if r.file != i or r.length == 0:
                    continue
                if r.gather:  # one request spanning the gaps
                    starts, lens = np.array([r.offset]), np.array([r.span])
                else:
                    starts = r.offset + np.arange(r.count, dtype=np.int64) * r.stride
                    lens = np.full(r.count, r.length)
                first.append(starts // PAGE)
                last.append((starts + lens - 1) // PAGE)
        f, l = np.concatenate(first), np.concatenate(last)
        np.add.at(diff, f, 1)
        np.add.at(diff, l + 1, -1)
        maps[ref.uri] = np.cumsum(diff[:-1]) > 0
    return maps


def rank_needs(rank_plan) -> dict:
    """{'exact': data bytes the shards need, 'pages': page-rounded bytes incl. headers, 'header': header bytes}."""
    maps = page_maps(rank_plan)
    headers = sum(_header_end(rank_plan.files[i].uri)
                  for i in sorted({r.file for t in rank_plan.tensors for r in t.reads}))
    return {"exact": rank_plan.stats.bytes_needed, "pages": int(sum(m.sum() for m in maps.values())) * PAGE,
            "header": headers, "shard": rank_plan.stats.shard_bytes}


def node_needs(plan, ranks=None) -> int:
    """Page-rounded bytes the union of `ranks` (default all) needs: what one node holding them must pull."""
    union: dict[str, np.ndarray] = {}
    for rp in plan.ranks if ranks is None else [plan.ranks[r] for r in ranks]:
        for path, m in page_maps(rp).items():
            union[path] = m | union[path] if path in union else m
    return int(sum(m.sum() for m in union.values())) * PAGE


def checkpoint_bytes(files: list[str]) -> int:
    return sum(os.path.getsize(p) for p in files)
