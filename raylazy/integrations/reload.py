"""vLLM's in-place reload (`reload_weights(weights_path=..., is_checkpoint_format=True)`) on raylazy's format.

vLLM's reload puts the model's parameters on the meta device, runs each weight loader first on them (counting
the elements `copy_` writes) and, once a layer's count is complete, again into fresh tensors it processes and
copies into the kernel's. So the weights it gets are lazy weights served synchronously: a copy into a meta
tensor reads nothing (it is only counted), a copy into a real one takes its region from a `Serving` that reads
this worker's regions of the new checkpoint in batches, with the node's other workers. Which regions: those the
first load recorded (`Kept`, on the model: vLLM makes a new loader for each reload), re-resolved by tensor name
against the new headers; a checkpoint whose tensors or shapes differ is recorded afresh: each region read alone
as it is taken, and kept for the next reload. A checkpoint every worker finds in the page cache is served by an
`AtOnce` instead: each copy straight out of its file's mapping, as a load copies it. Headers, file sizes and the
regions are checked before vLLM writes anything (a failure then leaves the engine as it was); a read failing after
that puts every unfinished layer's old tensors back and raises `ReloadError`: the engine then holds a mix of old
and new weights until reloaded.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ..core.boxes import Region
from ..core.checkpoint import Checkpoint
from ..errors import ReloadError, first_line
from ..io.nodes import NodeGroup
from ..io.regions import opened
from ..io.report import summary
from ..io.serving import AtOnce, Serving
from ..io.stats import Meter
from .lazy import lazy_weights
from .recording import Served

#: The model attribute that keeps what a reload needs of the first load.
KEPT = "raylazy_kept"


@dataclass
class Kept:
    """What a reload needs of the load before it: the checkpoint the weights came from (vLLM's `model`,
    `model_weights`, `revision`), each tensor's shape, the regions taken and how often ((name, starts, sizes) ->
    takes), the parameters' device and bytes as loaded."""

    source: tuple[str, str, str | None]
    shapes: dict[str, tuple[int, ...]]
    takes: dict[tuple, int]
    device: torch.device
    param_bytes: int

    def regions(self, ckpt: Checkpoint) -> tuple[dict[Region, int], str]:
        """(takes of the regions in `ckpt`, why they are not the recorded ones: "" where they are)."""
        now = {t.name: (fi, t) for fi, t in ckpt.tensors()}
        gone = next((n for n in self.shapes if n not in now), None)
        if gone is not None or len(now) != len(self.shapes):
            new = next((n for n in now if n not in self.shapes), None)
            return {}, f"tensor {gone!r} is gone" if gone else f"tensor {new!r} is new"
        changed = next((n for n, s in self.shapes.items() if tuple(now[n][1].shape) != s), None)
        if changed is not None:
            return {}, f"tensor {changed!r} has shape {list(now[changed][1].shape)}, not {list(self.shapes[changed])}"
        return {Region(*now[name], starts, sizes): n for (name, starts, sizes), n in self.takes.items()}, ""


def key(region: Region) -> tuple:
    return region.tensor.name, region.starts, region.sizes


def keep(model: torch.nn.Module, model_config, ckpt: Checkpoint, takes: dict[Region, int], param_bytes: int) -> None:
    """Keep on `model` what its next reload needs (`Kept`)."""
    setattr(model, KEPT, Kept((model_config.model, model_config.model_weights, model_config.revision),
                              {t.name: tuple(t.shape) for _, t in ckpt.tensors()}, {key(r): n for r, n in takes.items()},
                              next(model.parameters()).device, param_bytes))


class _Run(Served):
    """What a reload's lazy weights take their bytes from: copies into meta tensors (vLLM's count) read nothing;
    every take is counted (the next reload's recording); a failed take undoes the reload's unfinished layers."""

    def __init__(self, serving: Serving | AtOnce, fail):
        super().__init__(serving)
        self.fail, self.taken = fail, Counter()

    def take(self, region: Region) -> torch.Tensor:
        return self._counted(region, super().take, region)

    def copy_into(self, dst: torch.Tensor, weight) -> torch.Tensor:
        if dst.is_meta:
            return dst.copy_(torch.empty(weight.shape, dtype=weight.dtype, device="meta"))
        return self._counted(weight.region, super().copy_into, dst, weight)

    def _counted(self, region: Region, how, *args) -> torch.Tensor:
        self.taken[key(region)] += 1
        try:
            return how(*args)
        except BaseException as e:  # noqa: BLE001  (re-raised by `fail` as a ReloadError)
            self.fail(e)

    def drain(self) -> None:
        """Every batch read before the serving is left: layers vLLM finishes after the last weight (padding,
        attention) take theirs then."""
        try:
            self.serving.drain()
        except BaseException as e:  # noqa: BLE001  (likewise)
            self.fail(e)


def weights_for_reload(model: torch.nn.Module, model_config, options, checkpoint, group: NodeGroup | None, logger,
                       take=lambda ckpt: None):
    """The weights vLLM's reload asks of the load format (`get_all_weights`): every check runs now, before vLLM
    touches the model, and every worker learns whether another's failed and whether all found the checkpoint in
    the page cache: then each copies at once (`AtOnce`), else all read through a `Serving` (one way for the
    engine: no worker waits in the node's gathering for another still copying while vLLM processes its layers);
    the bytes are read as the iterator is used. `checkpoint(model_config, options)` opens the checkpoint's
    headers; `take(checkpoint)`, a holder's bytes of it (`raylazy.integrations.held`)."""
    kept: Kept | None = getattr(model, KEPT, None)
    if kept is None:
        raise ReloadError(f"reloading from {_path(model_config)} with load_format='raylazy': this engine's weights were "
                          "not loaded with raylazy's format, whose first load records what a reload reads; nothing "
                          "was written: reload with the format the engine was loaded with, or start it with "
                          "load_format='raylazy'")
    meter, new = Meter(), _path(model_config)

    def failure(worker: int, why: str, own) -> ReloadError:
        model_config.model, model_config.model_weights, model_config.revision = kept.source
        return ReloadError(f"reloading from {new} failed before any weight was written (worker {worker}: {why}); "
                           f"the engine keeps the weights of {_path(model_config)}")

    reads, at_once = opened(lambda: checkpoint(model_config, options), options, group,
                            lambda reads: reads.copies_at_once(), failure, take)
    takes, afresh = kept.regions(reads.ckpt)
    serving = AtOnce(reads) if all(at_once) else Serving(reads, takes, {}, group, kept.device)
    return _serve(model, model_config, kept, reads, serving, takes, afresh, meter, group, logger)


def _path(model_config) -> str:
    return model_config.model_weights or model_config.model


def _serve(model, model_config, kept: Kept, reads, serving, takes, afresh, meter, group, logger):
    ckpt, run = reads.ckpt, _Run(serving, lambda e: _abandon(model, model_config, e))
    with reads, serving:
        yield from lazy_weights(ckpt, run)
        run.drain()
    seconds, rchar = meter.elapsed()
    mode, why = (("reload-at-once", reads.copied_from) if isinstance(serving, AtOnce) else
                 ("reload-recorded", f"recorded afresh: {afresh}") if afresh else ("reload-reused", ""))
    logger.info(summary(group.rank if group else 0, reads.stats, ckpt.nbytes, kept.param_bytes, mode, why, rchar,
                        seconds))
    kept.takes = dict(run.taken | Counter({key(r): n for r, n in takes.items()}))
    kept.source = (model_config.model, model_config.model_weights, model_config.revision)
    kept.shapes = {t.name: tuple(t.shape) for _, t in ckpt.tensors()}


def _abandon(model: torch.nn.Module, model_config, error: BaseException):
    """A read failed while vLLM was writing layers: every layer not finished gets its old tensors back (vLLM's
    own fallback for a layer that loaded nothing), so the engine can run, on a mix of old and new weights."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, finalize_layerwise_reload

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            info.load_numel, info.loaded_weights = 0, []
    finalize_layerwise_reload(model, model_config)
    raise ReloadError(f"reloading from {_path(model_config)} failed after vLLM began writing the weights "
                      f"({type(error).__name__}: {first_line(error)}); the engine now holds a mix of old and new "
                      "weights: reload again before serving") from error
