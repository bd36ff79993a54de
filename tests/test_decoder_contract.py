"""The decoder contract: a batch of sequences, each with its own positions, in; logits per sequence out."""

import pytest
import torch

from smoe.errors import SmoeError
from smoe.quality.evaluate import load_reference
from smoe.runtime.decoder import FastDecoder, GenericDecoder, SequenceStep, open_decoder
from smoe.runtime.model import OpenedVault
from smoe.testing import vaults
from smoe.testing.tiny_models import tiny_families


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    sm = OpenedVault(vaults.tiny_vault(tmp_path_factory.mktemp("contract"), "qwen3_moe"), dtype="float32")
    yield sm
    sm.close()


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(decoder, ids: list[int], split: int) -> list[torch.Tensor]:
    first = decoder.forward([SequenceStep("alone", ids[:split], 0)])[0]
    rest = decoder.forward([SequenceStep("alone", ids[split:], split)])[0]
    decoder.release("alone")
    return [first, rest]


def test_generic_decoder_keeps_each_sequence_of_a_batch_to_its_own_positions(opened):
    a, b = tokens(1, 12), tokens(2, 7)
    dec = GenericDecoder(opened)
    want_a, want_b = alone(dec, a, 5), alone(dec, b, 3)
    first = dec.forward([SequenceStep("a", a[:5], 0), SequenceStep("b", b[:3], 0)])
    second = dec.forward([SequenceStep("b", b[3:], 3), SequenceStep("a", a[5:], 5)])
    for got, want in ((first[0], want_a[0]), (first[1], want_b[0]), (second[1], want_a[1]), (second[0], want_b[1])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_step_that_does_not_continue_its_sequence_is_refused(opened):
    for dec in (GenericDecoder(opened), open_decoder(opened, "fast", 64)):
        dec.forward([SequenceStep("s", tokens(3, 4), 0)])
        with pytest.raises(SmoeError, match="starts at position 3, but 4 tokens are held"):
            dec.forward([SequenceStep("s", [1], 3)])
        dec.release("s")
        with pytest.raises(SmoeError, match="starts at position 2, but 0 tokens are held"):
            dec.forward([SequenceStep("never-begun", [1], 2)])


def test_fast_decoder_keeps_each_sequence_of_a_batch_on_its_own_state(opened):
    a, b = tokens(4, 12), tokens(5, 7)
    dec = open_decoder(opened, "fast", 64)
    assert isinstance(dec, FastDecoder) and dec.max_sequences == 16
    want_a, want_b = alone(GenericDecoder(opened), a, 5), alone(GenericDecoder(opened), b, 3)
    first = dec.forward([SequenceStep("a", a[:5], 0), SequenceStep("b", b[:3], 0)])
    second = dec.forward([SequenceStep("b", b[3:], 3), SequenceStep("a", a[5:], 5)])
    for got, want in ((first[0], want_a[0]), (first[1], want_b[0]), (second[1], want_a[1]), (second[0], want_b[1])):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    with pytest.raises(SmoeError, match="at most 16 sequence"):
        dec.forward([SequenceStep(i, [1], 0) for i in range(15)])


def test_a_released_sequence_state_serves_the_next_sequence_from_its_beginning(opened):
    dec = open_decoder(opened, "fast", 64)
    dec.forward([SequenceStep("a", tokens(12, 9), 0)])
    held = dec.states["a"]
    dec.release("a")
    b = tokens(13, 6)
    got = dec.forward([SequenceStep("b", b, 0)])[0]
    assert dec.states["b"] is held and held.length == 6  # reused, not reallocated, and begun again
    torch.testing.assert_close(got, GenericDecoder(opened).forward([SequenceStep("b", b, 0)])[0], rtol=1e-3, atol=1e-3)


def test_generic_decoder_refuses_more_sequences_than_it_holds(opened):
    dec = GenericDecoder(opened, max_sequences=2)
    dec.forward([SequenceStep(i, [1, 2], 0) for i in range(2)])
    with pytest.raises(SmoeError, match="at most 2 sequence"):
        dec.forward([SequenceStep(2, [1], 0)])
    dec.release(0)
    assert dec.forward([SequenceStep(2, [1], 0)])[0].shape[0] == 1


def test_a_batch_names_each_sequence_once_and_gives_it_tokens(opened):
    dec = GenericDecoder(opened)
    with pytest.raises(SmoeError, match="one step per sequence"):
        dec.forward([SequenceStep("s", [1], 0), SequenceStep("s", [2], 1)])
    with pytest.raises(SmoeError, match="at least one token"):
        dec.forward([SequenceStep("s", [], 0)])


@pytest.mark.parametrize("family", tiny_families())
def test_generic_decoder_continues_every_family_as_the_reference_recomputes(family, tmp_path):
    """Prefill, then one-token steps on the KV cache the family's model builds for itself (MiniMax and
    the hybrid models keep caches of their own kind): each step's logits are the dequantised
    reference's over the whole prefix."""
    vault, reference = vaults.tiny_vault_and_reference(tmp_path, family, seed=2)
    sm = OpenedVault(vault, dtype="float32", decoder="generic")
    ids, ref = tokens(6, 14), load_reference(reference)
    dec = open_decoder(sm, "auto", 64)
    got = [dec.forward([SequenceStep("s", ids[:10], 0)])[0][-1]]
    got += [dec.forward([SequenceStep("s", [t], 10 + i)])[0][-1] for i, t in enumerate(ids[10:])]
    want = ref(torch.tensor([ids]))[0, 9:]
    sm.close()
    assert float((torch.stack(got) - want).abs().max() / want.abs().max()) < 1e-4


def test_fast_decoder_continues_a_sequence_as_the_generic_decoder_does(opened):
    ids = tokens(7, 12)
    fast, generic = open_decoder(opened, "fast", 64), GenericDecoder(opened)
    for start, end in ((0, 6), (6, 7), (7, 12)):
        a = fast.forward([SequenceStep("s", ids[start:end], start)])[0]
        b = generic.forward([SequenceStep("s", ids[start:end], start)])[0]
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_a_fast_decoder_sequence_is_not_disturbed_by_other_users_of_the_vault(opened):
    a = tokens(8, 9)
    want = GenericDecoder(opened).forward([SequenceStep("a", a, 0)])[0][-1]
    first, second = open_decoder(opened, "fast", 64), open_decoder(opened, "fast", 64)
    first.forward([SequenceStep("a", a[:5], 0)])
    second.forward([SequenceStep("b", tokens(9, 5), 0)])  # the vault's one fast decoder runs another sequence
    opened.logits(torch.tensor([tokens(10, 4)]))  # teacher-forced rows use it too
    opened.fast_decoder(16).forward(tokens(14, 3))  # and a caller of the decoder itself, on its own state
    got = first.forward([SequenceStep("a", a[5:], 5)])[0][-1]
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_a_refused_batch_leaves_the_held_sequences_as_they_were(opened):
    dec, ids = open_decoder(opened, "fast", 64), tokens(11, 6)
    dec.forward([SequenceStep("a", ids[:5], 0)])
    with pytest.raises(SmoeError, match="at most 16 sequence"):
        dec.forward([SequenceStep("a", ids[:5], 0), *(SequenceStep(i, [1], 0) for i in range(16))])
    assert dec.forward([SequenceStep("a", ids[5:], 5)])[0].shape[0] == 1
