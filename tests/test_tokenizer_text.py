"""Text through the vault's tokenizer: completions' text_offset (where each token's text starts, in one pass
of the tokenizer's incremental decoder, equal to the length of the text decoded before the token), and the
plain chat turns of a model without a chat template; the text of a growing sequence, a token at a time."""

import random

import pytest

from smoe.cli.demo import MODEL
from smoe.hf.tokenizer import CLEANUP_PROBE, Detokenizer, chat_prompt, load_tokenizer, text_offsets
from smoe.testing.tiny_models import save_tiny_tokenizer

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


# --- the text of a growing sequence, a token at a time (smoe.hf.tokenizer.Detokenizer) -------------

def metaspace_tokenizer(tmp_path):
    """A SentencePiece-style BPE (Llama's, Mistral's): "▁" for spaces, and the first one dropped on decoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator([TEXT * 20], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"] + alphabet))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def wordpiece_cleaning_tokenizer(tmp_path):
    """A WordPiece tokenizer that asks for transformers' cleanup of spaces ("a ." -> "a."), BERT's way."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator([TEXT * 20 + CLEANUP_PROBE], trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", clean_up_tokenization_spaces=True)


def tiny_model_tokenizer(tmp_path):
    """The tiny models' own: whitespace-split BPE with no decoder (pieces joined by spaces)."""
    save_tiny_tokenizer(tmp_path, 200)
    return load_tokenizer(tmp_path)


TOKENIZERS = {"byte-level BPE (the demo model's)": lambda tmp_path: load_tokenizer(MODEL),
              "SentencePiece-style BPE": metaspace_tokenizer, "WordPiece cleaning up spaces": wordpiece_cleaning_tokenizer,
              "whitespace BPE without a decoder": tiny_model_tokenizer}


@pytest.mark.parametrize("special", [True, False], ids=["special tokens kept", "special tokens skipped"])
@pytest.mark.parametrize("make", TOKENIZERS.values(), ids=TOKENIZERS.keys())
def test_the_text_pushed_a_token_at_a_time_is_the_whole_decode(make, special, tmp_path):
    """Real text, and random ids that end characters mid-way; each piece is returned once, and what remains at
    the end (a character left incomplete) comes from rest(). A cleanup of spaces rewrites text already returned
    ("a '" then "a's"): there the text is still the whole decode, the pieces only what followed its length."""
    tok = make(tmp_path)
    rng = random.Random(0)
    # not SentencePiece's byte pieces: a byte that ends no character turns the whole decode's earlier bytes of its
    # run into U+FFFD as well ("E" then "E\x8e" decodes "\ufffd\ufffd"), text no stream can take back
    ids = [i for t, i in tok.get_vocab().items() if not t.startswith("<0x")]
    for sequence in (tok(TEXT * 3)["input_ids"], [rng.choice(ids) for _ in range(500)]):
        text = Detokenizer(tok, special)
        pieces = [text.push(token) for token in sequence]
        rest = text.rest()
        assert text.text == tok.decode(sequence, skip_special_tokens=not special)
        assert "".join(pieces) + rest == text.text or text.stream is None


def test_only_a_tokenizer_whose_decode_is_its_backends_decodes_incrementally(tmp_path):
    assert Detokenizer(load_tokenizer(MODEL)).stream is not None
    assert Detokenizer(metaspace_tokenizer(tmp_path)).stream is not None
    assert Detokenizer(wordpiece_cleaning_tokenizer(tmp_path)).stream is None  # "a ." becomes "a." after decoding


def test_dropped_ids_are_left_out_of_the_text(tok):
    ids = tok("The sea<|endoftext|> was calm")["input_ids"]
    end = tok.convert_tokens_to_ids("<|endoftext|>")
    text = Detokenizer(tok, special=True, dropped=[end])
    assert "".join(text.push(token) for token in ids) + text.rest() == "The sea was calm"
    assert end not in text.tokens
