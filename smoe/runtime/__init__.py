"""Running a vault: the opened model, expert caches, decoders per device, sampling and generation."""
