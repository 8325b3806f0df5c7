"""Runs inside the vLLM virtualenv (tests/integrations/test_declared_vllm.py starts it): which region of every checkpoint tensor
vLLM's own weight loaders take on each tensor-parallel rank, for several checkpoints, from one engine start.

An engine is started on the first checkpoint; then each of its workers builds, for every checkpoint in turn, vLLM's
model of it and runs the model's `load_weights` over raylazy's recording lazy weights (raylazy.integrations.lazy),
which read nothing for what they can follow and note each region a weight loader copies or uses. Prints one line, `RESULT` and JSON: per checkpoint,
per rank, {tensor: [[starts, sizes, opaque], ...]} (opaque: an op the recording cannot follow took it), or the
error building or loading the model raised.
"""

from __future__ import annotations

import argparse
import json


def record(worker, dirs: list[str], tp: int) -> dict:
    """Runs in each worker: {checkpoint: {tensor: regions} or {"error": ...}}."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    from raylazy.core.options import ServingOptions
    from raylazy.integrations.lazy import lazy_weights
    from raylazy.integrations.recording import Recording
    from raylazy.io.regions import RegionReader
    from raylazy.storage import open_checkpoint

    serving = worker.vllm_config
    layers = serving.compilation_config.static_forward_context
    out = {}
    for d in dirs:
        serving.compilation_config.static_forward_context = {}
        try:
            cfg = EngineArgs(model=d, tensor_parallel_size=tp, dtype="float32", skip_tokenizer_init=True,
                             enforce_eager=True, max_model_len=128).create_engine_config()
            loader = get_model_loader(LoadConfig(load_format="dummy"))
            with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
                model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
                ckpt = open_checkpoint(d)
                with RegionReader(ckpt, ServingOptions()) as reads:  # reads only what an op it cannot follow uses
                    recording = Recording(reads.read_alone)
                    with recording.watching():
                        model.load_weights(lazy_weights(ckpt, recording))
            regions: dict[str, list] = {}
            for region in dict.fromkeys([c.region for c in recording.copies] + list(recording.opaque)):
                regions.setdefault(region.tensor.name, []).append(
                    [list(region.starts), list(region.sizes), region in recording.opaque])
            out[d] = regions
        except Exception as e:  # noqa: BLE001  (reported per checkpoint: the others are still recorded)
            out[d] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            serving.compilation_config.static_forward_context = layers
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    from vllm import LLM

    llm = LLM(model=args.dirs[0], tensor_parallel_size=args.tp, dtype="float32", skip_tokenizer_init=True,
              enforce_eager=True, max_model_len=128, max_num_seqs=1, seed=0)
    try:
        ranks = llm.collective_rpc(record, args=(args.dirs, args.tp))
    finally:
        llm.llm_engine.engine_core.shutdown()
    print("RESULT " + json.dumps({d: [r[d] for r in ranks] for d in args.dirs}), flush=True)


if __name__ == "__main__":
    main()
