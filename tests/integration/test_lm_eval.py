"""lm-evaluation-harness as a real client: its `local-completions` model against `smoe serve` and its
`hf` model on the `smoe dequantize` checkpoint of the same vault score the same cloze items and
write the same greedy continuations (tasks in tests/integration/lm_eval_task)."""

import json
import os
from pathlib import Path

import yaml

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when datasets is imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from smoe.testing.vaults import dequantised_reference  # noqa: E402

TASKS = Path(__file__).resolve().parent / "lm_eval_task"
# Both sides run the same float32 weights; summation order alone separates them. Measured: at most
# 9e-6 on the shared model, 2e-6 on the tiny one, summed over a choice's tokens.
LOGLIK_ATOL = 1e-4


def task_configs(cache: Path) -> list[dict]:
    """The task YAMLs with their data files made absolute (datasets reads them relative to the cwd)."""
    configs = []
    for name in ("smoe_cloze", "smoe_greedy"):
        config = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
        files = {split: str(TASKS / f) for split, f in config["dataset_kwargs"]["data_files"].items()}
        configs.append(config | {"dataset_kwargs": {"data_files": files, "cache_dir": str(cache)}})
    return configs


def evaluate(model: str, model_args: dict, cache: Path) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=task_configs(cache),
                                   task_manager=TaskManager(include_defaults=False),
                                   batch_size=1, bootstrap_iters=0, log_samples=True)


def samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def logliks(results: dict) -> list[float]:
    return [ll for s in samples(results, "smoe_cloze") for ll, _ in s["filtered_resps"]]


def generations(results: dict) -> list[str]:
    return [s["filtered_resps"][0] for s in samples(results, "smoe_greedy")]


def names_eos(vault: Path) -> bool:
    """Whether the model's config names an end-of-text token (the tiny random model's does not)."""
    files = [vault / "config.json", vault / "generation_config.json"]
    return any(json.loads(f.read_text()).get("eos_token_id") is not None for f in files if f.exists())


def test_lm_eval_scores_the_server_like_the_dequantized_checkpoint(serve_vault, start_server, tmp_path):
    server = start_server(serve_vault)
    served = {tokenized: evaluate("local-completions", {
        "model": "smoe", "base_url": f"{server.url}/v1/completions", "tokenizer": str(serve_vault),
        "tokenizer_backend": "huggingface", "tokenized_requests": tokenized,
        "num_concurrent": 1, "max_retries": 1}, tmp_path / "datasets") for tokenized in (True, False)}
    checkpoint = dequantised_reference(serve_vault, tmp_path, name="hf")
    local = evaluate("hf", {"pretrained": str(checkpoint), "dtype": "float32", "device": "cpu"}, tmp_path / "datasets")

    acc = local["results"]["smoe_cloze"]["acc,none"]
    for tokenized, got in served.items():
        gap = max(abs(a - b) for a, b in zip(logliks(got), logliks(local), strict=True))
        print(f"\nlm_eval {'token-id' if tokenized else 'text'} prompts: cloze acc server "
              f"{got['results']['smoe_cloze']['acc,none']:.2f}, hf {acc:.2f}; max |Δ loglik| {gap:.1e} over "
              f"{len(logliks(local))} choices; greedy {generations(got)}")
        assert got["results"]["smoe_cloze"]["acc,none"] == acc
        assert gap < LOGLIK_ATOL
        if names_eos(serve_vault):
            assert generations(got) == generations(local)
        else:  # lm_eval's hf model also stops at the tokenizer's </s>; smoe, like transformers' generate,
            # runs past it and leaves it out of its text, so lm_eval's stop string "</s>" never matches
            assert all(s.startswith(h) for s, h in zip(generations(got), generations(local), strict=True))
