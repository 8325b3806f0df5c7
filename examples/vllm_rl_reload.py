"""An RL-shaped loop on vLLM: each step a "trainer" task writes a new safetensors checkpoint, and a running vLLM
engine loaded with load_format="raylazy" reloads it in place (each of its workers reads only its bytes).

    python examples/vllm_rl_reload.py [--steps 3] [--tp 1] [--work DIR]
    ray job submit --working-dir . -- python examples/vllm_rl_reload.py

Needs vLLM (its CPU build will do) and raylazy in the environment of Ray's workers. The engine is a Ray actor,
started once; the trainer is a Ray task that reads the last checkpoint, nudges every weight and writes the next
one beside it. After each reload the example checks the engine's prompt logprobs: equal, bit for bit, to those of
a fresh engine (vLLM's default loader) started on that step's checkpoint, and different from the step before's
(a reload that did nothing fails). Prints one JSON line per step; exits 1 on a failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import ray

#: A small Llama (raylazy.synthetic's layout); the prompts whose logprobs are compared.
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
             num_hidden_layers=2, vocab_size=512)
PROMPTS = [[1, 2, 3, 4, 5], [17, 300, 42, 9]]
#: Small engines: vLLM's engine core in the actor's process, a 1 GiB KV cache on a CPU build.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"}


@ray.remote
def train_step(src: str, dst: str, step: int) -> str:
    """The trainer's step: every weight of checkpoint `src` nudged, written as checkpoint `dst` (same layout)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    gen = torch.Generator().manual_seed(step)
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(src, name))
            save_file({k: (t.float() + 0.05 * torch.randn(t.shape, generator=gen)).to(t.dtype)
                       for k, t in tensors.items()}, os.path.join(dst, name), metadata={"format": "pt"})
    return dst


@ray.remote(runtime_env={"env_vars": ENV})
class Engine:
    """A vLLM engine on checkpoint `path`, loaded with `load_format`."""

    def __init__(self, path: str, tp: int, load_format: str):
        from vllm import LLM, SamplingParams

        self.llm = LLM(model=path, load_format=load_format, tensor_parallel_size=tp, dtype="float32",
                       skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, seed=0)
        self.params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)

    def reload(self, path: str) -> float:
        """Reloads the weights in place from `path` (as an RL framework does): its seconds."""
        start = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path, "is_checkpoint_format": True})
        return time.perf_counter() - start

    def logprobs(self) -> list[list[float]]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], self.params, use_tqdm=False)
        return [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--work", default=None, help="where the checkpoints are written (default: a temporary directory)")
    args = ap.parse_args()
    from raylazy.synthetic import LlamaShape, write_llama_checkpoint

    work = args.work or tempfile.mkdtemp(prefix="vllm-rl-")
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local")  # a Ray job gets RAY_ADDRESS; else a Ray of its own
    last = write_llama_checkpoint(os.path.join(work, "step-0"), LlamaShape(**SHAPE))
    engine = Engine.remote(last, args.tp, "raylazy")
    before, ok = ray.get(engine.logprobs.remote()), True
    for step in range(1, args.steps + 1):
        last = ray.get(train_step.remote(last, os.path.join(work, f"step-{step}"), step))
        seconds = ray.get(engine.reload.remote(last))
        now = ray.get(engine.logprobs.remote())
        fresh = Engine.remote(last, args.tp, "auto")
        expected = ray.get(fresh.logprobs.remote())
        ray.kill(fresh)
        same, changed = now == expected, now != before
        ok &= same and changed
        print(json.dumps({"step": step, "reload_s": round(seconds, 3), "equals_fresh_engine": same,
                          "changed": changed}), flush=True)
        before = now
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
