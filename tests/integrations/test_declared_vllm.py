"""Fused, interleaved and expert tensors against the inference convention: vLLM's own weight loaders.

In the vLLM virtualenv (tests/integrations/test_vllm.py builds it), tests/support/vllm/regions.py records, from one engine start at
tp=2, which region of every checkpoint tensor vLLM's loaders take on each rank (raylazy's lazy-weights recording
follows narrow, slicing, chunk and split, and notes a region an op it cannot follow took as opaque). Each rank's
raylazy plan (its presets and declared plans, no vLLM) must take the same rows of every tensor vLLM takes. A
region the recording could not follow is no reference: such tensors (MoE experts that vLLM's fused-MoE loader
reads whole today) are left out, and the test says which.

vLLM's engine start and each model it builds cost ~10 s of CPU here: the suite records `SUITE` (a fused q|k|v and
gate|up, GPT-NeoX's per-head q,k,v with its `embed_out`, DeepSeek-V2's latent attention and experts);
`-m matrix` records every architecture of `ARCHS` both support. `LEFT_OUT` says why the others are not compared.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import raylazy
from benchmarks.harness.tiny_checkpoints import write_checkpoint
from benchmarks.harness.vllm_engines import SIZES
from tests.core.test_declared import ARCHS as DECLARED
from tests.integrations.test_vllm import vllm_python  # noqa: F401  (the fixture)
from tests.support import REPO

pytestmark = pytest.mark.own_processes  # vLLM's engines, in vLLM's virtualenv

TP = 2
ARCHS = ("apertus", "arcee", "cohere", "cohere2", "deepseek_v2", "ernie4_5", "exaone4", "gemma", "gemma2",
         "gemma3_text", "glm4", "gpt_neox", "granite", "helium", "llama", "ministral3", "mistral", "mixtral", "olmo",
         "olmo2", "olmo3", "phi", "phi3", "qwen2", "qwen2_moe", "qwen3", "seed_oss", "smollm3", "starcoder2")
SUITE = ("phi3", "glm4", "gpt_neox", "deepseek_v2")
#: Architectures of tests/core/test_declared.py's matrix not compared here, and why.
LEFT_OUT = {
    "glm": "vLLM serves it with its transformers backend, which shards as transformers' plan does (gate|up cut "
           "contiguously, the output gathered); raylazy holds to the native engines' halves, as vLLM's glm4 does",
    "gptj": "vLLM's transformers (< 5.20) refuses the config transformers 5.24 writes (partial_rotary_factor)",
    "internlm3": "vLLM's transformers (< 5.20) does not know the model type",
}
#: The tensors whose regions the recording cannot follow: MoE experts (vLLM's fused-MoE loader reads them in ways
#: it does not follow yet: it reads them whole), Apertus's activation scalars (`.item()`).
OPAQUE = {"mixtral": ("w1", "w2", "w3"), "qwen2_moe": ("experts",), "apertus": ("act_fn",)}


def _selected(config) -> tuple[str, ...]:
    return ARCHS if "matrix" in (config.getoption("markexpr") or "") else SUITE


def pytest_generate_tests(metafunc):
    if "arch" in metafunc.fixturenames:
        metafunc.parametrize("arch", _selected(metafunc.config))


@pytest.fixture(scope="module")
def regions(request, vllm_python, tmp_path_factory):  # noqa: F811
    """{arch: (checkpoint dir, per rank {tensor: [[starts, sizes, opaque], ...]} or {"error": ...})}."""
    root = tmp_path_factory.mktemp("declared_vllm")
    dirs = {a: write_checkpoint(a, str(root), DECLARED[a], SIZES) for a in _selected(request.config)}
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(TP)))
    done = subprocess.run([vllm_python, str(REPO / "tests" / "support" / "vllm" / "regions.py"), "--tp", str(TP), *dirs.values()],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=1500)
    assert done.returncode == 0, done.stdout[-6000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return {a: (d, result[d]) for a, d in dirs.items()}


def _rows(boxes, shape) -> tuple:
    """Boxes of a tensor as (dim, merged [start, stop) intervals along it); (None, ()) for the whole tensor."""
    cut = {d for starts, sizes in boxes for d, (n, full) in enumerate(zip(sizes, shape)) if n != full}
    if not cut:
        return None, ()
    assert len(cut) == 1, f"boxes cut dims {sorted(cut)}: {boxes}"
    (dim,) = cut
    merged: list[list[int]] = []
    for start, stop in sorted((s[dim], s[dim] + z[dim]) for s, z in boxes):
        if merged and merged[-1][1] == start:
            merged[-1][1] = stop
        else:
            merged.append([start, stop])
    return dim, tuple(map(tuple, merged))


def _planned(shard) -> tuple:
    if shard.dim is None:
        return None, ()
    boxes = []
    for src, _, length in shard.pieces:
        starts, sizes = [0] * len(shard.full_shape), list(shard.full_shape)
        starts[shard.dim], sizes[shard.dim] = src, length
        boxes.append((starts, sizes))
    return _rows(boxes, shard.full_shape)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.timeout(1800)
def test_plan_takes_the_rows_vllm_takes(regions, arch):
    d, ranks = regions[arch]
    assert "error" not in ranks[0], f"vLLM could not build {arch}: {ranks[0]['error']}"
    plan = raylazy.plan(d, TP)
    for rank, (rp, taken) in enumerate(zip(plan.ranks, ranks)):
        opaque = sorted(n for n, boxes in taken.items() if any(o for _, _, o in boxes))
        assert all(any(f".{p}." in n for p in OPAQUE.get(arch, ())) for n in opaque), opaque
        shards = {t.name: t for t in rp.tensors}
        assert set(taken) <= set(shards), f"vLLM takes tensors raylazy does not plan: {set(taken) - set(shards)}"
        assert set(shards) - set(taken) == set(), f"raylazy plans tensors vLLM does not take on rank {rank}"
        for name, boxes in taken.items():
            if name in opaque:
                continue
            shard = shards[name]
            theirs = _rows([(s, z) for s, z, _ in boxes], shard.full_shape)
            assert _planned(shard) == theirs, f"{arch} rank {rank}: {name} ({shard.placement})"
