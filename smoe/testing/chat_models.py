"""A tiny model that chats through a real chat template: a byte-level tokenizer (so JSON, tags and
any text are representable) carrying the template, the template's markers as tokens, and a random
qwen3_moe model sized to that vocabulary."""

from __future__ import annotations

from pathlib import Path

import torch

from smoe.testing.tiny_models import TOKENIZER_TEXT, randomise, tiny_config
from smoe.testing.vaults import vault_of

VOCAB = 384  # the 256 bytes, the markers, and some merges
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# written by chat templates as text (Qwen's tokenizer keeps them as single, non-special tokens)
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
TRAINING_TEXT = TOKENIZER_TEXT + ' {"name": "get_weather", "arguments": {"city": "Paris"}} tool call result answer'


def save_chat_tokenizer(out_dir: Path, chat_template: str) -> dict[str, int]:
    """A byte-level BPE tokenizer with `chat_template`; returns the ids of its special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(MARKERS), special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    return {t: tok.token_to_id(t) for t in SPECIAL}


def chat_vault(tmp: Path, chat_template: str, seed: int = 0) -> Path:
    """tmp/chat-vault: a random tiny qwen3_moe whose tokenizer carries `chat_template`, sculpted at 4 bits."""
    import transformers

    model_dir = Path(tmp) / "chat-model"
    ids = save_chat_tokenizer(model_dir, chat_template)
    config = tiny_config("qwen3_moe")
    config.vocab_size, config.max_position_embeddings = VOCAB, 2048  # room for a template's tool preamble
    config.eos_token_id, config.bos_token_id, config.pad_token_id = ids["<|im_end|>"], None, ids["<|endoftext|>"]
    torch.manual_seed(seed)
    model = randomise(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.save_pretrained(model_dir, safe_serialization=True)
    return vault_of(model_dir, Path(tmp) / "chat-vault")
