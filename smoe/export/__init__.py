"""Exports of a vault for other runtimes: GGUF for llama.cpp, MLX for mlx-lm."""
