"""The layering the README states, beyond the import contract `lint-imports` checks statically: the core, storage
and the readers import and read a plan in a process where Ray cannot be imported at all (as on the GPU check's
machine, which has no Ray), importing the package's face imports no Ray, and importing a layer imports none above
it (the package's face imports its names on first use: the vLLM plugin, imported by every vLLM process, pays for
no Ray layer)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.checkpoints import reference_tensors

SCRIPT = """
import sys
sys.modules["ray"] = None  # `import ray` now raises ImportError, wherever it happens
import raylazy  # the face: imports no Ray
from raylazy.io.backends import read_rank
from raylazy.planning import make_plan
plan = make_plan(sys.argv[1], 2)
shards, stats = read_rank(plan.ranks[1], "cpu")
import torch
torch.save({n: t.clone() for n, t in shards.items()}, sys.argv[2])
print("no ray:", "ray" not in [m for m in sys.modules if sys.modules[m] is not None])
print("above:", sorted(m for m in sys.modules if m.startswith(("raylazy.cluster", "raylazy.integrations"))))
print("face:", raylazy.plan is make_plan, raylazy.Split.__module__)
"""


def test_the_core_storage_and_readers_need_no_ray(llama_dir, tmp_path):
    out = tmp_path / "rank1.pt"
    done = subprocess.run([sys.executable, "-c", SCRIPT, llama_dir, str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no ray: True" in done.stdout
    assert "above: []" in done.stdout
    assert "face: True raylazy.core.placements" in done.stdout
    import torch

    shards, ref = torch.load(out), reference_tensors(llama_dir)
    q = ref["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(shards["model.layers.0.self_attn.q_proj.weight"], q.chunk(2, 0)[1])
    down = ref["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(shards["model.layers.0.mlp.down_proj.weight"], down.chunk(2, -1)[1])
