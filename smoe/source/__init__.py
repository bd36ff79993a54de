"""Reading what users bring: Hugging Face checkpoints with bounded memory, quantised sources, and `families`
with the modules beside it (layouts, matching, config_numbers, config_checks, loading), the one place that
knows tensor names and config keys."""
