"""transformers' and huggingface_hub's own progress bars under smoe.progress's rule: drawn only on a terminal."""

from __future__ import annotations

import os
import sys


def quiet_library_bars() -> None:
    """The same rule for the bars of transformers and huggingface_hub (loading weights, writing
    shards), through their documented switch, which they read on import; a user's setting wins."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported already (smoe used as a library): switch it now
        from transformers.utils import logging

        logging.disable_progress_bar()
