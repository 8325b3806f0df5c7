"""Runs under `torchrun --nproc-per-node N` (tests/core/test_declared.py starts it): loads each checkpoint with transformers' own
tensor-parallel loading (`from_pretrained(dir, tp_plan="auto")`, gloo on CPUs) and writes what this rank holds.

For each `DIR`, rank r writes `OUT/<basename of DIR>/rank<r>.safetensors`, every parameter's local part (the DTensor's
local shard, or the whole tensor) under its disk name (transformers' own reverse weight conversion of that part:
per-expert tensors of fused experts, `embed_out` for `lm_head`, ...), and rank 0 `styles.json`: disk name -> the
style transformers' plan gives its parameter (null: none), or an error the load raised.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings


def local_parts(model) -> tuple[dict, dict]:
    """({disk name: this rank's part}, {disk name: style}) of every tensor of `model`'s state dict."""
    from torch.distributed.tensor import DTensor
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.distributed.parallel_utils import _get_parameter_plan

    parts, styles = {}, {}
    for name, tensor in model.state_dict().items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        for disk, part in revert_weight_conversion(model, {name: local.detach().clone()}).items():
            parts[disk] = part.contiguous()
            styles[disk] = _get_parameter_plan(name, model.tp_plan)
    return parts, styles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    for d in args.dirs:
        out = os.path.join(args.out, os.path.basename(d))
        os.makedirs(out, exist_ok=True)
        try:
            model = AutoModelForCausalLM.from_pretrained(d, tp_plan="auto", dtype=torch.bfloat16)
            parts, styles = local_parts(model)
        except Exception as e:  # noqa: BLE001  (reported per checkpoint: the others still load)
            parts, styles = {}, {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        rank = dist.get_rank()
        save_file(parts, os.path.join(out, f"rank{rank}.safetensors"))
        if rank == 0:
            with open(os.path.join(out, "styles.json"), "w") as f:
                json.dump(styles, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
