"""Pipeline stages: which layers each stage holds (vLLM's partition, or one given), and the stages of a tensor.

A tensor whose name has a layer index (`...layers.<i>.`) belongs to the stage holding layer i. Others go
where the first matching rule that names a stage says: `"first"`, `"last"`, `"all"`, or `"embedding"` (the
first stage, and the last too when the word embeddings are tied: the last stage uses them as its head).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Literal

from ..errors import ConfigurationError, StageError

Stage = Literal["first", "last", "all", "embedding"]

#: `layers.<i>.` at the start of a name or after a dot, spelled to begin with the literal (as `placements._EXPERT`).
_LAYER = re.compile(r"layers\.(?<![^.]layers\.)(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor name belongs to (the number after its first `layers.`), or None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def partition(num_layers: int, pp: int, pp_layers: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per stage: `pp_layers` when given (checked: pp counts summing to num_layers), else vLLM's
    `get_pp_indices` split: num_layers // pp each, the remainder one more each to the stages just before the
    last (stage pp-2, then pp-3, ...), since the last stage also holds the final norm and the head."""
    if pp_layers is not None:
        if len(pp_layers) != pp or sum(pp_layers) != num_layers:
            raise ConfigurationError(f"pp_layers={list(pp_layers)} must give {pp} stage(s) layer counts summing to the "
                                     f"model's {num_layers} layers (config.json num_hidden_layers)")
        return tuple(pp_layers)
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        counts[-i] += 1
    return tuple(counts)


def tensor_stages(
    names: Sequence[str | None],
    ruled: Sequence[str],
    counts: Sequence[int],
    stage_rule: Callable[[str], Stage | None],
    tied: bool,
    extra: int = 0,
) -> list[tuple[int, ...] | None]:
    """The stages that hold each name of `names` (None: a tensor not loaded, held by none), the stages holding
    `counts` layers each in order. `stage_rule(ruled[i])` gives the stage a rule names for a tensor without a
    layer index (None: no rule does); `tied`: the word embeddings are the head too; `extra`: layers after the
    last (multi-token prediction) the last stage holds."""
    pp, layers = len(counts), sum(counts)
    by_layer = [(s,) for s, n in enumerate(counts) for _ in range(n)] + [(pp - 1,)] * extra  # layer -> its stage
    named = {"first": (0,), "last": (pp - 1,), "all": tuple(range(pp)),
             "embedding": tuple(sorted({0, pp - 1})) if tied else (0,)}
    spelled = {str(i): stages for i, stages in enumerate(by_layer)}  # a layer's digits -> its stage
    out: list[tuple[int, ...] | None] = []
    search = _LAYER.search
    for name, rule_name in zip(names, ruled):
        m = name and search(name)
        if m:
            stages = spelled.get(m.group(1))
            if stages is None:  # past the last layer, or spelled otherwise (`layers.07.`)
                layer = int(m.group(1))
                if layer >= len(by_layer):
                    raise StageError(f"tensor {name!r} is in layer {layer}, but the model has {layers} layers "
                                     f"(config.json's num_hidden_layers; layers 0-{layers - 1}) and {extra} "
                                     "multi-token-prediction layer(s) after them (num_nextn_predict_layers; kept with "
                                     f"keep_mtp=True); skip the layer with rules=[('*layers.{layer}.*', Skip())]")
                stages = by_layer[layer]
            out.append(stages)
        elif name is None:
            out.append(None)
        else:
            stage = stage_rule(rule_name)
            if stage is None:
                raise StageError(f"tensor {name!r} has no layer index (no 'layers.<i>.' in its name) and no rule names "
                                 "its pipeline stage: add one, e.g. rules=[Rule('" + name + "', Replicated(), "
                                 "stage='first')] ('first', 'last', 'all' or 'embedding')")
            out.append(named[stage])
    return out
