"""Model inputs named by a Hugging Face hub id (`Qwen/Qwen3-30B-A3B`), found in the local hub cache.

smoe never downloads: a hub id resolves to its snapshot in the cache (HF_HUB_CACHE, HF_HOME, or
~/.cache/huggingface/hub) offline, or the error says how to download it.
"""

from __future__ import annotations

import re
from pathlib import Path

from smoe.errors import SmoeError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME, as the hub spells repository ids


def resolve_model(given: str) -> str:
    """`given` itself when it exists or cannot be a hub id; else the cached snapshot of that hub id."""
    if given is None or Path(given).exists() or not REPO_ID.fullmatch(given):
        return given
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(given, local_files_only=True)
    except LocalEntryNotFoundError:
        raise SmoeError(f"{given}: no such directory, nor a model in the local Hugging Face cache; if it is a hub id, "
                        f"download it first: `hf download {given}` (older huggingface_hub: "
                        f"`huggingface-cli download {given}`)") from None
