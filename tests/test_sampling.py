"""The sampler (smoe/runtime/sampling.py): exact values against transformers' logits processors and hand-computed
references, per-row independence in a batch, and safety at every value in range."""

import itertools
import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from smoe.runtime.sampling import SamplingParams, Sequence, penalised, probabilities, sample_batch, token_logprobs

V = 50


def logits_rows(b: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


def softmax_of(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.double(), dim=-1)


@pytest.mark.parametrize("penalty", [0.3, 1.0, 1.2, 2.5])
def test_repetition_penalty_matches_transformers(penalty):
    logits = logits_rows()
    history = [3, 7, 7, 11, 40]
    reference = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits.clone())
    seq = Sequence(SamplingParams(repetition_penalty=penalty), prompt=history[:2], output=history[2:])
    torch.testing.assert_close(penalised(logits, [seq]), reference, rtol=0, atol=1e-12)


def test_frequency_and_presence_penalties_subtract_count_times_frequency_plus_presence():
    logits = logits_rows()
    seq = Sequence(SamplingParams(frequency_penalty=0.7, presence_penalty=-1.5), prompt=[1, 2, 2], output=[5, 5, 5, 9])
    expected = logits.clone()
    expected[0, 5] -= 3 * 0.7 + -1.5
    expected[0, 9] -= 1 * 0.7 + -1.5  # prompt tokens 1 and 2 are not counted, as OpenAI counts
    torch.testing.assert_close(penalised(logits, [seq]), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 5, 1.0, 0.0), (0.7, 1, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (1.0, 0, 0.3, 0.0), (0.8, 0, 1.0, 0.1),
    (1.0, 0, 1.0, 0.5), (1.5, 10, 0.8, 0.05), (2.0, V, 1.0, 0.0),
])
def test_truncation_matches_transformers_warpers(temperature, top_k, top_p, min_p):
    logits = logits_rows()
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    torch.testing.assert_close(probabilities(logits, [Sequence(params)]), softmax_of(scores), rtol=0, atol=1e-12)


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])
    probs = probabilities(logits, [Sequence(SamplingParams(temperature=1.0, top_k=2))])
    assert (probs[0] > 0).tolist() == [True, True, True, True, False]


def test_greedy_takes_the_argmax_of_the_penalised_logits():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    seq = Sequence(SamplingParams(repetition_penalty=2.0), prompt=[0])
    assert sample_batch(logits, [seq]) == [1] and seq.output == [1]
    assert probabilities(logits, [Sequence(SamplingParams())]).tolist() == [[1.0, 0.0, 0.0]]


def test_logit_bias_is_added_to_the_raw_logits_before_the_penalties():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    assert sample_batch(logits, [Sequence(SamplingParams(logit_bias=((2, 100.0),)))]) == [2]
    assert sample_batch(logits, [Sequence(SamplingParams(logit_bias=((0, -100.0),)))]) == [1]
    # (4 + 4) / 2 = 4 stays below token 0's 5; the penalty first would give 4 / 2 + 4 = 6
    penalised_after = Sequence(SamplingParams(repetition_penalty=2.0, logit_bias=((1, 4.0),)), prompt=[1])
    assert sample_batch(logits, [penalised_after]) == [0]
    sampled = [Sequence(SamplingParams(temperature=1.0, seed=s, logit_bias=((2, 100.0),))) for s in range(8)]
    assert [sample_batch(logits, [q])[0] for q in sampled] == [2] * 8
    assert "logit bias on 1 token" in SamplingParams(logit_bias=((2, 1.0),)).line()


def test_each_row_of_a_batch_samples_as_it_would_alone():
    logits = logits_rows(3, seed=1)
    params = [SamplingParams(temperature=0.9, top_k=8, seed=1, repetition_penalty=1.3),
              SamplingParams(),
              SamplingParams(temperature=1.5, min_p=0.05, frequency_penalty=1.0, presence_penalty=0.5, seed=2)]
    histories = [([1, 2], [3]), ([4], []), ([], [6, 6, 7])]

    def seqs():
        return [Sequence(p, list(a), list(b)) for p, (a, b) in zip(params, histories)]

    batch, alone = seqs(), seqs()
    together = [sample_batch(logits, batch) for _ in range(5)]
    separate = [[sample_batch(logits[i:i + 1], [alone[i]])[0] for i in range(3)] for _ in range(5)]
    assert together == separate
    torch.testing.assert_close(probabilities(logits, seqs()),
                               torch.cat([probabilities(logits[i:i + 1], [s]) for i, s in enumerate(seqs())]))


def test_the_same_seed_draws_the_same_tokens():
    logits = logits_rows()

    def draw(seed):
        seq = Sequence(SamplingParams(temperature=1.0, seed=seed))
        return [sample_batch(logits, [seq])[0] for _ in range(30)]

    assert draw(3) == draw(3) and draw(3) != draw(4)


EXTREMES = {
    "temperature": [0.0, 5e-324, 1e-300, 2.0], "top_k": [0, 1, V + 5], "top_p": [0.0, 1e-12, 1.0],
    "min_p": [0.0, 1.0], "repetition_penalty": [5e-324, 1e300], "frequency_penalty": [-2.0, 2.0],
    "presence_penalty": [-2.0, 2.0],
}


def test_every_value_in_range_gives_a_distribution_and_a_valid_token():
    logits = logits_rows() * 100
    names = list(EXTREMES)
    for values in itertools.product(*EXTREMES.values()):
        seq = Sequence(SamplingParams(**dict(zip(names, values))), prompt=list(range(0, V, 2)), output=[1, 1, 3])
        probs = probabilities(logits, [seq])
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-9, values
        assert 0 <= sample_batch(logits, [seq])[0] < V, values


def test_token_logprobs_are_the_models_log_softmax_with_the_top_n():
    logits = logits_rows(2)
    entries = token_logprobs(logits, [4, 9], 3)
    logp = torch.log_softmax(logits, -1)
    for row, entry in zip(logp, entries):
        assert math.isclose(entry.logprob, float(row[entry.token]), abs_tol=1e-12)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
        assert all(math.isclose(lp, float(row[t]), abs_tol=1e-12) for t, lp in entry.top)
    assert token_logprobs(logits, [4, 9], 0)[0].top == []


# --- the command line ----------------------------------------------------------------------------

def test_cli_sampling_options_reach_the_sampler(tmp_path):
    from smoe.cli.commands import build_parser, sampling_params

    args = build_parser().parse_args(["generate", "v", "-p", "x", "--temperature", "0.5", "--top-k", "3", "--min-p",
                                      "0.2", "--repeat-penalty", "1.1", "--frequency-penalty", "-2",
                                      "--presence-penalty", "2", "--seed", "9"])
    assert sampling_params(args, tmp_path) == SamplingParams(0.5, 0.95, 3, 0.2, 1.1, -2.0, 2.0, 9)  # top_p: llama.cpp's


@pytest.mark.parametrize("option, value", [("--top-k", "-1"), ("--top-k", "1.5"), ("--min-p", "1.01"),
                                           ("--repeat-penalty", "0"), ("--repeat-penalty", "nan"),
                                           ("--frequency-penalty", "2.5"), ("--presence-penalty", "-3")])
def test_cli_sampling_options_out_of_range_are_usage_errors(option, value, capsys):
    from smoe.cli.commands import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "v", "-p", "x", option, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {option}" in err and "expected" in err
