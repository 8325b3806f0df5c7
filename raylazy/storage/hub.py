"""Resolve a model id (`org/name`, `org/name@revision`) to its snapshot in the local Hugging Face cache.

Nothing is downloaded and no network is touched: `huggingface_hub.snapshot_download`
runs with `local_files_only=True`, so it only reads the cache's standard layout
(`models--org--name/refs/<revision>` -> `snapshots/<commit>/`). The cache is the
one huggingface_hub uses: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
`~/.cache/huggingface/hub` (read when called, so a process may set them late).
"""

from __future__ import annotations

import os
import re

from ..errors import CheckpointNotFoundError, ModelNotCachedError

#: `name` or `namespace/name`, optionally `@revision` (a branch, tag or commit hash).
_MODEL_ID = re.compile(r"^(?P<repo>[\w.-]+(?:/[\w.-]+)?)(?:@(?P<revision>[\w./-]+))?$")


def hub_cache_dir() -> str:
    """The Hugging Face hub cache directory, from the environment as huggingface_hub documents it."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")


def resolve_model(model: str | os.PathLike) -> str:
    """A local path as given; a model id not present as a path -> its cached snapshot directory."""
    text = os.fspath(model)
    if os.path.exists(text) or "://" in text:
        return text
    m = _MODEL_ID.match(text)
    if m is None or text.startswith((".", "/", "~")):
        raise CheckpointNotFoundError(f"{os.path.abspath(text)}: no such file or directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo, revision, cache = m["repo"], m["revision"], hub_cache_dir()
    try:
        return snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        where = os.path.join(cache, "models--" + repo.replace("/", "--"))
        raise ModelNotCachedError(
            f"{text!r} is neither a local path nor a model in the local Hugging Face cache: looked for revision "
            f"{revision or 'main'!r} in {where} (cache from HF_HUB_CACHE / HF_HOME). raylazy never downloads: "
            f"fetch it first (`hf download {repo}{' --revision ' + revision if revision else ''}`) or pass a "
            "model directory"
        ) from None
