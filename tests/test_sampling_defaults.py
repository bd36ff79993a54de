"""One sampling default everywhere: the fields a model's generation_config.json sets, over llama.cpp's;
flags and request fields replace them one by one; a random seed is reported and replays the same tokens."""

import json
import sys
from dataclasses import replace

import pytest
import torch

from smoe.errors import SmoeError
from smoe.hf.tokenizer import load_tokenizer
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import (
    LLAMA_CPP_DEFAULTS,
    SamplingParams,
    Sequence,
    chosen,
    model_defaults,
    sample_batch,
    sampling_defaults,
)

QWEN3_DEFAULTS = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05)  # min_p: llama.cpp's
PROMPT = "The sea was"


# --- where the defaults come from ---------------------------------------------------------------

def test_llama_cpps_defaults_apply_when_the_generation_config_sets_no_sampling_field(sampling_vaults):
    assert LLAMA_CPP_DEFAULTS == SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    assert sampling_defaults(sampling_vaults["plain"]) == LLAMA_CPP_DEFAULTS
    assert model_defaults(None) == model_defaults({"eos_token_id": 2, "top_p": None}) == LLAMA_CPP_DEFAULTS


def test_the_fields_a_generation_config_sets_replace_llama_cpps_one_by_one(sampling_vaults):
    assert sampling_defaults(sampling_vaults["qwen3"]) == QWEN3_DEFAULTS
    assert model_defaults({"repetition_penalty": 1.1}) == SamplingParams(0.8, 0.95, 40, 0.05, repetition_penalty=1.1)


def test_do_sample_false_is_greedy_keeping_the_repetition_penalty():
    assert model_defaults({"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.2}) == \
        SamplingParams(temperature=0.0, repetition_penalty=1.2)


@pytest.mark.parametrize("key, value", [("temperature", "hot"), ("temperature", -1), ("top_k", 2.5), ("top_p", 1.5),
                                        ("min_p", True), ("repetition_penalty", 0)])
def test_a_bad_sampling_value_in_generation_config_is_an_error_naming_the_file_and_key(key, value):
    with pytest.raises(SmoeError, match=rf"^model/generation_config.json: {key}: expected "):
        model_defaults({key: value}, "model/generation_config.json")


def test_given_fields_replace_the_defaults_and_a_missing_seed_is_drawn():
    params = chosen(QWEN3_DEFAULTS, temperature=1.2, top_k=None, seed=None)
    assert params.temperature == 1.2 and params.top_k == 20 and isinstance(params.seed, int)
    assert chosen(QWEN3_DEFAULTS, seed=5).seed == 5
    assert len({chosen(QWEN3_DEFAULTS).seed for _ in range(4)}) == 4
    with pytest.raises(TypeError, match="not sampling settings: temp"):
        chosen(QWEN3_DEFAULTS, temp=1.0)


def test_temperature_zero_is_greedy_over_every_other_default():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    for seed in range(5):
        seq = Sequence(chosen(LLAMA_CPP_DEFAULTS, temperature=0.0, seed=seed))
        assert sample_batch(logits, [seq]) == [int(logits.argmax())]


# --- the entry points ---------------------------------------------------------------------------

def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(sampling_vaults):
    sm = OpenedVault(sampling_vaults["plain"], dtype="float32")
    try:
        run = lambda seed: generate(sm, [1, 2, 3], 12, params=chosen(LLAMA_CPP_DEFAULTS, temperature=1.5, seed=seed))[0]
        assert run(7) == run(7) and run(7) != run(8)
    finally:
        sm.close()


def test_generate_json_reports_the_seed_it_drew_and_that_seed_gives_the_same_tokens(sampling_vaults, capsys):
    from smoe.cli.commands import main

    vault = sampling_vaults["qwen3"]
    assert main(["generate", str(vault), "-p", "The sea", "--max-tokens", "8", "--json", "--dtype", "float32"]) == 0
    out = json.loads(capsys.readouterr().out)
    seed = out["sampling"]["seed"]
    assert isinstance(seed, int) and out["sampling"] == QWEN3_DEFAULTS.as_dict() | {"seed": seed}
    sm = OpenedVault(vault, dtype="float32")
    try:
        prompt = load_tokenizer(vault)("The sea")["input_ids"]
        assert generate(sm, prompt, 8, params=chosen(sampling_defaults(vault), seed=seed))[0] == out["tokens"]
    finally:
        sm.close()


def test_every_route_fills_what_a_request_leaves_out_with_the_models_defaults(sampling_vaults):
    from smoe.serve.anthropic_api import anthropic_reply
    from smoe.serve.openai_api import openai_reply
    from smoe.serve.schemas import ChatCompletionRequest, CompletionRequest, MessagesRequest
    from smoe.serve.worker import Worker

    sm = OpenedVault(sampling_vaults["qwen3"], dtype="float32")
    try:
        worker = Worker(sm, load_tokenizer(sampling_vaults["qwen3"]), "m")  # not started: only its settings are read
        messages = [{"role": "user", "content": "hi"}]
        requests = [(openai_reply, ChatCompletionRequest(messages=messages)),
                    (openai_reply, CompletionRequest(prompt="x")),
                    (anthropic_reply, MessagesRequest(messages=messages, max_tokens=4))]
        for reply, req in requests:
            params = reply(worker, req, 4).params
            assert replace(params, seed=None) == QWEN3_DEFAULTS and isinstance(params.seed, int), type(req)
            given = reply(worker, req.model_copy(update={"temperature": 0.3, "top_k": 2}), 4).params
            assert replace(given, seed=None) == replace(QWEN3_DEFAULTS, temperature=0.3, top_k=2), type(req)
    finally:
        sm.close()


def test_smoe_load_generate_samples_with_the_vaults_defaults(sampling_vaults):
    import smoe

    for name, want in (("qwen3", QWEN3_DEFAULTS), ("plain", LLAMA_CPP_DEFAULTS)):
        model = smoe.load(sampling_vaults[name], dtype="float32")
        try:
            config = model.generation_config
            assert config.do_sample is True, name
            assert (config.temperature, config.top_k, config.top_p, config.min_p) == \
                (want.temperature, want.top_k, want.top_p, want.min_p), name
        finally:
            model.smoe_runtime.close()


def test_the_chat_banner_says_how_it_samples_and_that_the_model_has_no_chat_template(sampling_vaults, monkeypatch,
                                                                                      capsys):
    import io

    from smoe.cli.commands import main

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8"))
    assert main(["chat", str(sampling_vaults["qwen3"]), "--dtype", "float32", "--seed", "3", "--top-k", "5"]) == 0
    err = capsys.readouterr().err
    assert "sampling: temperature 0.6, top-k 5, top-p 0.95, min-p 0.05, seed 3 (defaults: the model's " \
           "generation_config.json)" in err
    assert "this model has no chat template: the conversation goes to it as plain text" in err
