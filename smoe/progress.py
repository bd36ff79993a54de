"""Progress bars: tqdm on stderr when it is a terminal, nothing otherwise.

A redirected stderr (a log file, CI, a pipe) would collect every `\\r` redraw of a bar as noise, so
every bar in smoe goes through `bar`, which draws only for a person watching a terminal.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(iterable=None, enabled: bool = True, **options) -> tqdm:
    """tqdm(iterable, **options), disabled unless `enabled` and stderr is a terminal."""
    return tqdm(iterable, disable=not (enabled and sys.stderr.isatty()), **options)
