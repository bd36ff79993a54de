"""`smoe serve`: the OpenAI/Anthropic-compatible HTTP API, its request worker and the web chat page."""
