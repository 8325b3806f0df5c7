"""Which `Storage` serves a URI: a factory per scheme (local files built in, object storage imported when first
used), one storage instance per distinct set of `storage_options`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import UnsupportedStorageError
from .base import Source, Storage, scheme_of
from .local import LocalStorage

#: Object-storage schemes served by `raylazy.storage.objects` (obstore: S3, Google Cloud Storage, Azure Blob).
OBJECT_SCHEMES = ("s3", "gs", "az")


def _object_storage(scheme: str) -> Callable[..., Storage]:
    def factory(**storage_options: Any) -> Storage:
        try:
            from .objects import ObjectStorage  # the optional `s3` extra: imported only when a URI needs it
        except ImportError as e:
            raise UnsupportedStorageError(f"{scheme}:// needs the obstore package ({e}): pip install 'raylazy[s3]'") from None
        return ObjectStorage(scheme, storage_options)
    return factory


_FACTORIES: dict[str, Callable[..., Storage]] = {"": LocalStorage, "file": LocalStorage,
                                                 **{s: _object_storage(s) for s in OBJECT_SCHEMES}}
_STORAGES: dict[tuple[str, str], Storage] = {}


def register_storage(scheme: str, factory: Callable[..., Storage]) -> None:
    """Serve URIs `scheme://...` with the Storage `factory(**storage_options)` returns (called once per distinct
    set of storage options, when first needed; with none, `factory()`)."""
    _FACTORIES[scheme] = factory
    for key in [k for k in _STORAGES if k[0] == scheme]:
        del _STORAGES[key]


def storage_for(uri: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The Storage serving `uri` (a plain path or a `file://` URI: the local one), built with `storage_options`."""
    scheme = scheme_of(uri)
    options = dict(storage_options or {})
    key = (scheme, repr(sorted(options.items())))
    storage = _STORAGES.get(key)
    if storage is None:
        factory = _FACTORIES.get(scheme)
        if factory is None:
            raise UnsupportedStorageError(
                f"{uri}: no storage serves the scheme {scheme!r} (known: "
                f"{', '.join(repr(s) for s in sorted(_FACTORIES) if s)}); register one with "
                "raylazy.storage.register_storage"
            )
        storage = _STORAGES[key] = factory(**options)
    return storage


def open_source(uri: str, storage_options: Mapping[str, Any] | None = None) -> Source:
    """Open `uri` with the storage serving it."""
    return storage_for(uri, storage_options).open(uri)
