"""Every error raylazy raises: one class per failure kind, all under RaylazyError.

Each kind sits under the family a caller would catch: CheckpointError (the files on
disk, headers included), ShardingError (the rules against the checkpoint),
PlanFormatError, ConfigurationError, PlacementError, and LoadError (reading on the
ranks). Messages name the file, the tensor and the numbers involved, and say how to
fix the problem where there is something the user can do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping


class RaylazyError(Exception):
    """Base of every error raylazy raises on purpose."""


# --- bases that the sections below share ----------------------------------------


class CheckpointError(RaylazyError):
    """A model directory that is not a usable safetensors checkpoint (a broken header included)."""


class PartialByteError(RaylazyError):
    """Bits that are not whole bytes (sub-byte dtypes): catch it for both kinds, a tensor in a
    header (PartialByteTensorError, a HeaderError) and a planned slice (PartialByteSliceError, a ShardingError)."""


# --- safetensors headers -----------------------------------------------------


class HeaderError(CheckpointError):
    """A safetensors file whose header breaks the format. `path` names the file."""

    def __init__(self, path: str, message: str):
        self.path = str(path)
        self.detail = message
        super().__init__(f"{self.path}: {message}")

    def __reduce__(self):  # keep the class and fields across Ray's pickling
        return (type(self), (self.path, self.detail))


class FileTooSmallError(HeaderError):
    """The file is shorter than the 8-byte header length prefix."""


class HeaderLengthError(HeaderError):
    """The header length prefix is over the cap or runs past the end of the file."""


class HeaderEncodingError(HeaderError):
    """The header bytes are not strict UTF-8."""


class HeaderJSONError(HeaderError):
    """The header is not one JSON object (or uses NaN/Infinity)."""


class DuplicateKeyError(HeaderError):
    """A JSON object in the header repeats a key."""


class TensorEntryError(HeaderError):
    """A tensor entry has missing, extra or ill-typed fields (shape, dtype, data_offsets)."""


class UnknownDTypeError(HeaderError):
    """A tensor entry names a dtype safetensors does not define."""


class MetadataError(HeaderError):
    """`__metadata__` is not a map of strings to strings."""


class DataLayoutError(HeaderError):
    """Tensor data has holes, overlaps, or offsets out of order."""


class TensorSizeError(HeaderError):
    """A tensor's byte length differs from shape x dtype size."""


class PartialByteTensorError(HeaderError, PartialByteError):
    """A tensor whose bit count is not a whole number of bytes."""


class FileSizeMismatchError(HeaderError):
    """The data does not end exactly at the end of the file (truncated or trailing bytes)."""


class TooManyEntriesError(HeaderError):
    """The header holds more JSON items, or more containers, than `raylazy.core.header.MAX_HEADER_ITEMS` (a bound on parse time and memory)."""


# --- checkpoints and model configs ---------------------------------------------


class CheckpointNotFoundError(CheckpointError):
    """No safetensors file (or index) in the directory."""


class ModelNotCachedError(CheckpointNotFoundError):
    """A model id (`org/name[@revision]`) that is not a local path and not in the local Hugging Face cache."""


class UnsafePathError(CheckpointError):
    """An index names a shard outside the model directory (traversal, absolute path)."""


class MissingShardError(CheckpointError):
    """A shard named by the index is not in the directory."""


class MissingTensorError(CheckpointError):
    """The index maps a tensor to a file that does not contain it."""


class DuplicateTensorError(CheckpointError):
    """The same tensor name appears in two files."""


class IndexFileError(CheckpointError):
    """`model.safetensors.index.json` is not valid JSON of the expected shape."""


class ModelConfigError(CheckpointError):
    """`config.json` is unreadable or has values of the wrong type."""


class QuantizationConfigError(ModelConfigError):
    """`config.json`'s `quantization_config` has missing or ill-typed fields for its `quant_method`."""


class QuantizedLayoutError(CheckpointError):
    """A quantized layer's tensors disagree with each other or with `quantization_config`: a scale that is not
    its weight's block or group grid, packed codes of another width, a companion without its weight."""


# --- sharding rules and plans --------------------------------------------------


class ShardingError(RaylazyError):
    """A tensor cannot be sharded as the rules say."""


class UnknownArchitectureError(ShardingError):
    """No preset for the model type and no user rules."""


class UnmatchedTensorError(ShardingError):
    """Tensors that no rule matches (every tensor must be sharded, replicated or skipped)."""


class IndivisibleDimError(ShardingError):
    """The world size does not divide the dimension being split."""


class RuleError(ShardingError):
    """A rule that cannot apply to the tensor it matched (dim out of range, head counts...)."""


class RuleFileError(RuleError):
    """A rules file (`--rules FILE`) that is not a JSON list of valid rules; names the file and the entry."""


class StageError(ShardingError):
    """A tensor no pipeline stage can be given: no layer index in its name and no rule naming its stage, or a
    layer index past config.json's `num_hidden_layers` (or no layer count to partition)."""


class UnsupportedQuantizationError(ShardingError):
    """A `quantization_config` whose method or format raylazy does not know how to shard (its scales and packed
    tensors would be placed by name alone, which is wrong)."""


class QuantizedSplitError(ShardingError):
    """A split that would cut inside a scale block, a quantization group or a packed word of a quantized tensor:
    the shard would pair codes with the wrong scales. Names the tensor, the block or group size and tp."""


class PartialByteSliceError(ShardingError, PartialByteError):
    """A slice of a sub-byte tensor that does not start and end on whole bytes."""


class PlanFormatError(RaylazyError):
    """A serialised plan that cannot be read back."""


# --- loading -----------------------------------------------------------------


class ConfigurationError(RaylazyError):
    """Invalid options passed to raylazy (wraps pydantic's validation report)."""

    @classmethod
    def from_validation(cls, error, what: str) -> ConfigurationError:
        """The error for a pydantic ValidationError of `what`, naming each bad field, its value and the problem."""
        return cls(f"invalid {what}: {validation_problems(error)}")


def validation_problems(error, field: str | None = None) -> str:
    """A pydantic ValidationError (of `field`, if given) as `field=value: problem; ...`, one entry per bad field."""
    out = []
    for err in error.errors():
        loc = ((field,) if field else ()) + tuple(err["loc"])
        out.append(f"{'.'.join(str(p) for p in loc)}={err.get('input')!r}: {err['msg']}" if loc else err["msg"])
    return "; ".join(out)


class LoadError(RaylazyError):
    """Loading on the ranks failed after planning and placement: a read, a file changed since
    planning, GPUDirect Storage, ranks that failed (RankFailedError) or hold no shards."""


class FileChangedError(LoadError):
    """A checkpoint file differs from the one the plan was made from."""


class ReloadError(LoadError):
    """Reloading a running vLLM engine's weights in place failed: before any weight was written (the engine keeps
    its weights), or after (the engine holds a mix of old and new weights until reloaded again)."""


class ReadError(LoadError):
    """Reading planned bytes failed (I/O error, permission, file truncated)."""


class StorageStallError(ReadError):
    """A storage request got no answer within `request_timeout_s` (a stalled mount or store); the read was given up."""


class BuffersInUseError(LoadError):
    """Tensors given to fill in place (`out`, a reload's held shards) that a read given up earlier (a
    StorageStallError) may still write into: refused until that read's blocked requests return."""


class LazyWeightError(LoadError):
    """A vLLM weight loader used a lazy weight in a way that cannot give eager torch's bytes (a view used after the
    tensor it views was changed in place): raised instead of loading different weights."""


class PeerFailedError(LoadError):
    """Exchanging bytes with the other ranks of a node failed: a peer rank failed, died or did not answer in time."""


class HolderError(LoadError):
    """A holder of a checkpoint's bytes in Ray (`raylazy.hold`) cannot serve a load."""


class StaleHolderError(HolderError):
    """The holder keeps another version of the checkpoint than the one on storage now (its files' headers, sizes,
    ETags or modification times differ): it is never served from; hold again to refresh it."""


class HolderFullError(HolderError):
    """The checkpoint does not fit the holder's budget of object-store bytes on a node: refused before a byte is read."""


class HolderGoneError(HolderError):
    """No live holder of the checkpoint was found, or it died or was released while a load took from it."""


class UnsupportedStorageError(CheckpointError):
    """A URI whose scheme no registered storage serves (see `raylazy.storage.register_storage`)."""


class StorageAccessError(CheckpointError):
    """The storage refused or failed a request while finding the checkpoint (credentials, endpoint, network)."""


class BufferMismatchError(ConfigurationError):
    """A caller-supplied destination tensor does not match its shard (shape, dtype, device, layout)."""


class LayoutMismatchError(ConfigurationError):
    """A checkpoint given to `LoadedModel.reload` whose rank shards differ from those loaded (names, shapes, dtypes)."""


class PlacementError(RaylazyError):
    """The cluster cannot place the rank actors (not enough GPUs, timed out)."""


class NoShardsError(LoadError):
    """A rank actor asked for shards it does not hold (never loaded, failed, released, or restarted)."""


class GDSUnavailableError(LoadError):
    """GPUDirect Storage is not usable on this node."""


def first_line(e: BaseException) -> str:
    """An error's message cut to its first non-empty line (empty for an error without a message)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


class RankFailedError(LoadError):
    """One or more ranks failed; `failures` maps each failed rank to its cause.

    The message lists each distinct cause once, with the ranks it hit: causes whose type and first line
    agree but for numbers (a rank, a byte offset) are one group, shown by its lowest rank's message."""

    def __init__(self, failures: Mapping[int, BaseException], context: str = "load"):
        self.failures = dict(sorted(failures.items()))
        self.context = context
        lines = [f"{context} failed on {len(self.failures)} rank(s):"]
        for ranks, err in group_failures(self.failures):
            others = " (the others' differ only in numbers)" if len(ranks) > 1 and any(
                first_line(self.failures[r]) != first_line(err) for r in ranks) else ""
            lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}: {type(err).__name__}: "
                         f"{first_line(err)}{others}")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (type(self), (self.failures, self.context))


_NUMBER = re.compile(r"\d+")


def group_failures(failures: Mapping[int, BaseException]) -> list[tuple[list[int], BaseException]]:
    """Ranks grouped by cause, in order of their lowest rank: causes of the same type whose first lines differ
    only in their numbers are one group; each group comes with its lowest rank's cause."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank in sorted(failures):
        err = failures[rank]
        groups.setdefault((type(err).__name__, _NUMBER.sub("#", first_line(err))), []).append(rank)
    return [(ranks, failures[ranks[0]]) for ranks in groups.values()]


def rank_ranges(ranks: list[int]) -> str:
    """Sorted ranks as runs: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
