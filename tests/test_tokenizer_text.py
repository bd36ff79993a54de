"""Text through the vault's tokenizer: completions' text_offset (where each token's text starts, in one pass
of the tokenizer's incremental decoder, equal to the length of the text decoded before the token), and the
plain chat turns of a model without a chat template."""

import pytest

from smoe.cli.demo import MODEL
from smoe.hf.tokenizer import chat_prompt, load_tokenizer, text_offsets

TEXT = "The sea<|endoftext|> was wörld 🙂 日本語  two  spaces\nnew line, and <|pad|> more"


@pytest.fixture
def tok():
    return load_tokenizer(MODEL)


@pytest.mark.parametrize("special", [True, False], ids=["special tokens kept", "special tokens skipped"])
def test_each_offset_is_the_length_of_the_text_decoded_before_its_token(tok, special):
    ids = tok(TEXT * 3)["input_ids"]
    offsets = text_offsets(tok, ids, special)
    prefixes = [tok.decode(ids[:i], skip_special_tokens=not special) for i in range(len(ids))]
    whole = [i for i, text in enumerate(prefixes) if not text.endswith("\ufffd")]  # ends on a whole character
    assert len(offsets) == len(ids) and len(whole) > len(ids) // 2
    assert [offsets[i] for i in whole] == [len(prefixes[i]) for i in whole]
    assert offsets == sorted(offsets) and offsets[-1] <= len(tok.decode(ids, skip_special_tokens=not special))


def test_a_token_ending_inside_a_character_points_where_that_character_starts(tok):
    ids = tok(" 🙂")["input_ids"]  # byte-level pieces: the emoji's four bytes span several tokens
    assert len(ids) > 2 and text_offsets(tok, ids, False) == [0] + [1] * (len(ids) - 1)


def test_a_tokenizer_whose_decode_cleans_up_spaces_gets_the_prefix_lengths(tok):
    """Its whole decode differs from its increments ("Hello , world" -> "Hello, world"): the offsets come
    from the prefixes themselves."""
    tok.clean_up_tokenization_spaces = True
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tok("Hello , world . ok")["input_ids"]
    assert tok.decode(ids) == "Hello, world. ok"
    assert text_offsets(tok, ids, False) == [len(tok.decode(ids[:i])) for i in range(len(ids))]


def test_no_tokens_have_no_offsets(tok):
    assert text_offsets(tok, [], True) == [] and text_offsets(tok, [], False) == []


def test_without_a_chat_template_each_turn_is_labelled_by_its_role(tok):
    """The plain "Role: text" turns of a model with no chat template: a tool's result is the tool's, not a
    turn the model wrote."""
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "Asking."}, {"role": "tool", "content": "Sunny."}]
    text = tok.decode(chat_prompt(tok, history))
    assert text == "System: Be brief.\nUser: Weather?\nAssistant: Asking.\nTool: Sunny.\nAssistant:"
