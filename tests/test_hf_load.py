"""`smoe.load`: a vault as a transformers model; `.generate()` and pipelines give the runtime's tokens."""

import gc

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel, pipeline

import smoe
from smoe.errors import SmoeError
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import GREEDY
from smoe.testing.vaults import tiny_vault

PROMPT = "the old man rowed out before the sun"
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def vault(request, tmp_path_factory):
    return tiny_vault(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def runtime_greedy(vault, prompt_ids: list[int]) -> list[int]:
    sm = OpenedVault(vault, dtype="float32")
    tokens, _ = generate(sm, prompt_ids, NEW_TOKENS, params=GREEDY)
    sm.close()
    return tokens


def test_load_returns_a_transformers_model_streaming_its_experts(vault):
    model = smoe.load(vault, dtype="float32")
    assert isinstance(model, PreTrainedModel)
    model(input_ids=torch.tensor([[1, 2, 3]]))
    assert model.smoe_runtime.store.stats.misses > 0  # experts came from the vault


def test_generate_gives_the_runtime_greedy_tokens(vault):
    tok = AutoTokenizer.from_pretrained(vault)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    model = smoe.load(vault, dtype="float32")
    gc.collect()  # nothing but the model holds the runtime now
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=0)
    assert out[0, ids.shape[1]:].tolist() == runtime_greedy(vault, ids[0].tolist())


def test_text_generation_pipeline_gives_the_runtime_greedy_tokens(vault):
    tok = AutoTokenizer.from_pretrained(vault)
    pipe = pipeline("text-generation", model=smoe.load(vault, dtype="float32"), tokenizer=tok)
    result = pipe(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, return_full_text=False)[0]["generated_text"]
    expected = runtime_greedy(vault, tok(PROMPT)["input_ids"])
    assert result == tok.decode(expected, skip_special_tokens=True)


def test_load_refuses_what_is_not_a_vault(tmp_path):
    with pytest.raises(SmoeError, match="not a vault"):
        smoe.load(tmp_path)
