"""Where checkpoint bytes come from: the storage interface (`base`), local files (`local`), object storage
(`objects`), the scheme registry (`registry`), checkpoint discovery (`discovery`), the Hugging Face cache
(`hub`), planned files opened and checked (`verified`), and a checkpoint's identity (`identity`)."""

from .base import Listing, NotAFileError, Source, Storage, local_path, scheme_of
from .discovery import open_checkpoint, read_header
from .identity import identity
from .local import LocalSource, LocalStorage
from .registry import OBJECT_SCHEMES, open_source, register_storage, storage_for
from .verified import Load, open_planned, open_planned_files, open_verified, read_error, reading, requested, stall_error

__all__ = ["identity", "Listing", "LocalSource", "LocalStorage", "NotAFileError", "OBJECT_SCHEMES", "Source", "Storage", "local_path",
           "open_checkpoint", "open_planned", "open_planned_files", "open_source", "open_verified", "read_header", "reading", "register_storage",
           "Load", "read_error", "requested", "stall_error",
           "scheme_of", "storage_for"]
