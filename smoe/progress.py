"""Progress bars: tqdm on stderr when it is a terminal, nothing otherwise.

A redirected stderr (a log file, CI, a pipe) would collect every `\\r` redraw of a bar as noise, so
every bar in smoe goes through `bar`, which draws only for a person watching a terminal.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def bar(iterable=None, enabled: bool = True, **options) -> tqdm:
    """tqdm(iterable, **options), disabled unless `enabled` and stderr is a terminal."""
    return tqdm(iterable, disable=not (enabled and sys.stderr.isatty()), **options)


def quiet_library_bars() -> None:
    """The same rule for the bars of transformers and huggingface_hub (loading weights, writing
    shards), through their documented switch, which they read on import; a user's setting wins."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported already (smoe used as a library): switch it now
        from transformers.utils import logging

        logging.disable_progress_bar()
