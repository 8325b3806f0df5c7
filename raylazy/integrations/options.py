"""The options of lazy weights' serving (`LazyOptions`), as vLLM's `model_loader_extra_config` gives them: flat."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from ..core.options import ReaderOptions, validated
from ..errors import ConfigurationError

#: Default bytes of regions read per batch (beyond those read straight into their destination).
DEFAULT_BATCH_BYTES = 256 << 20


class LazyOptions(BaseModel):
    """How lazy weights are served: the reader (`ReaderOptions`: backend, threads, queue_size, chunk_bytes, ...),
    row gaps read through (`max_gap`, as for `raylazy.plan`: None, 0 on local files and the storage's cost model
    deciding each strided region on object storage), the batches (about `batch_bytes` of regions each besides
    those read in place; `batches_ahead` read beyond the ones being used: host memory about (batches_ahead + 2)
    x batch_bytes), `replay` (False: a recorded consumer is run a second time, never replayed) and `warm_copies`
    (True: where the backend copies out of the files' mappings, "auto" or "cooperative", and the files are in the
    page cache, nothing is recorded: the consumer's one run copies each region out of the mapping as it asks;
    False: always record, read and replay)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    reader: ReaderOptions = ReaderOptions()
    max_gap: int | None = Field(None, ge=0)
    batch_bytes: int = Field(DEFAULT_BATCH_BYTES, ge=4096)
    batches_ahead: int = Field(1, ge=0, le=64)
    replay: bool = True
    warm_copies: bool = True


def lazy_options(options: Mapping | None) -> LazyOptions:
    """Validate flat options (the reader's and LazyOptions' own): a ConfigurationError names each bad or unknown one."""
    if not isinstance(options, Mapping):
        raise ConfigurationError(f"options must be a mapping of option names to values, got {type(options).__name__}")
    reader = {k: v for k, v in options.items() if k in ReaderOptions.model_fields}
    rest = {k: v for k, v in options.items() if k not in reader}
    return validated(LazyOptions, **rest, reader=validated(ReaderOptions, **reader))
