"""A checkpoint's identity: one digest that changes whenever a file of it may hold other bytes, so that bytes kept
elsewhere (a holder's, `raylazy.hold`) are served only for the checkpoint they were read from."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

from ..core.plans import FileRef
from .base import local_path


def identity(files: Iterable[FileRef]) -> str:
    """The digest of every file's name, size, header digest and version tag (an object's ETag), and, for a file on
    a file system, its inode and modification time (one `stat`, no byte of data read): a file rewritten in place
    with the same header (new weights, one layout) changes it too."""
    h = hashlib.sha256()
    for ref in files:
        path = local_path(ref.uri)
        stamp = ""
        if path is not None:
            st = os.stat(path)
            stamp = f"{st.st_ino}:{st.st_mtime_ns}"
        h.update(f"{os.path.basename(ref.uri)}\0{ref.size}\0{ref.digest}\0{ref.version}\0{stamp}\n".encode())
    return h.hexdigest()[:32]
