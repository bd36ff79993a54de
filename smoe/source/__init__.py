"""Reading what users bring: Hugging Face checkpoints with bounded memory, quantised sources, and `families`,
the one place that knows tensor names and config keys."""
