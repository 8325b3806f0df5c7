"""The benchmark's checkpoint: a Llama-shaped model written by transformers' save_pretrained, built once.

`ensure_checkpoint(spec, cache_dir)` returns a directory holding the model for
`spec` (shapes, dtype, seed, shard size), building it on first use into
`cache_dir/<key>` (written to a temporary directory, fsynced so the page cache can
later drop it, then renamed into place) and reusing it afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace

MARKER = ".raylazy-bench.json"


@dataclass(frozen=True)
class ModelSpec:
    """Llama shapes. `layers=None`: as many layers as bring the bf16 checkpoint closest to `size_gb`."""

    hidden: int = 2048
    intermediate: int = 5632
    heads: int = 32
    kv_heads: int = 8
    layers: int | None = None
    vocab: int = 32000
    size_gb: float = 2.0
    shard_size: str = "400MB"
    seed: int = 0
    dtype: str = "bfloat16"  # the checkpoint's (a torch dtype's name)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        h, i, d = self.hidden, self.intermediate, self.head_dim
        return h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 3 * h * i + 2 * h

    def fixed_params(self) -> int:
        return 2 * self.vocab * self.hidden + self.hidden  # embed_tokens, lm_head (untied), final norm

    def resolved(self) -> ModelSpec:
        if self.layers is not None:
            return self
        layers = round((self.size_gb * 1e9 / 2 - self.fixed_params()) / self.layer_params())
        return replace(self, layers=max(1, layers))

    def params(self) -> int:
        s = self.resolved()
        return s.fixed_params() + s.layers * s.layer_params()

    def nbytes(self) -> int:
        return self.params() * _dtype(self.dtype).itemsize

    def key(self) -> str:
        s = asdict(self.resolved())
        s.pop("size_gb")
        if s["dtype"] == "bfloat16":  # the key every bf16 checkpoint had before the dtype was a choice
            s.pop("dtype")
        text = json.dumps(s, sort_keys=True)
        return (f"llama-h{self.hidden}-i{self.intermediate}-l{self.resolved().layers}-v{self.vocab}-"
                + hashlib.sha1(text.encode()).hexdigest()[:8])

    def describe(self) -> str:
        s = self.resolved()
        return (f"Llama-shaped, {s.dtype}: hidden {s.hidden}, intermediate {s.intermediate}, {s.heads} heads "
                f"({s.kv_heads} kv, head_dim {s.head_dim}), {s.layers} layers, vocab {s.vocab}, untied lm_head; "
                f"{self.params() / 1e9:.2f} B parameters = {self.nbytes() / 1e9:.2f} GB; "
                f"save_pretrained(max_shard_size={s.shard_size!r})")


def default_cache_dir() -> str:
    return os.environ.get("RAYLAZY_BENCH_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "raylazy", "bench")


def ensure_checkpoint(spec: ModelSpec, cache_dir: str | None = None, log=print) -> str:
    """The directory of `spec`'s checkpoint under `cache_dir`, built there if missing."""
    spec = spec.resolved()
    cache_dir = cache_dir or default_cache_dir()
    out = os.path.join(cache_dir, spec.key())
    if os.path.isfile(os.path.join(out, MARKER)):
        return out
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    log(f"building the checkpoint ({spec.describe()}) in {out} ...")
    build(spec, tmp)
    for name in os.listdir(tmp):  # dirty pages cannot be dropped: make them clean now
        fd = os.open(os.path.join(tmp, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    with open(os.path.join(tmp, MARKER), "w") as fh:
        json.dump({**asdict(spec), "params": spec.params()}, fh, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    log(f"built in {time.perf_counter() - t0:.1f} s")
    return out


def build(spec: ModelSpec, out_dir: str) -> None:
    """Write `spec`'s model with `save_pretrained`, every weight drawn from a seeded normal distribution."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    spec = spec.resolved()
    config = LlamaConfig(
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        num_hidden_layers=spec.layers,
        vocab_size=spec.vocab,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=_dtype(spec.dtype))
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            # transformers initialises norms to ones: random values everywhere make slicing bugs visible
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32).to(param.dtype))
    model.save_pretrained(out_dir, max_shard_size=spec.shard_size)


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def checkpoint_files(model_dir: str) -> list[str]:
    return sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))
