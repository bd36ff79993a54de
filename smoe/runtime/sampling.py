"""The sampler: per-sequence parameters over a batch of logits rows, and the log-probabilities reported.

Order, as in transformers' and vLLM's pipelines: penalties on the raw logits (repetition, then
frequency and presence), then temperature, then top_k, top_p and min_p; temperature 0 is greedy
over the penalised logits. Each row of a [B, V] logits tensor has its own `SamplingParams`, its own
token history and its own random generator, so sequences of a batch never influence each other.

Logprobs are the model's log-softmax over the raw logits (what OpenAI reports, and what evaluation
harnesses need for log-likelihood), not of the penalised, tempered or truncated distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FLOAT64_MAX = torch.finfo(torch.float64).max


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 0 keeps only the most likely token
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # keep tokens of at least min_p times the top token's probability
    repetition_penalty: float = 1.0  # seen tokens' logits divided by it when positive, multiplied when negative
    frequency_penalty: float = 0.0  # logit -= count * frequency_penalty
    presence_penalty: float = 0.0  # logit -= (count > 0) * presence_penalty
    seed: int = 0

    def penalises(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass
class Sequence:
    """One row's parameters and state: the repetition penalty sees prompt and output, frequency and
    presence penalties only the output (as OpenAI and vLLM count them)."""
    params: SamplingParams
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    generator: torch.Generator = None

    def __post_init__(self):
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed % 2**64)


def penalised(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[B, V] float64 logits after each row's penalties; finite wherever the input was finite
    (a huge penalty saturates at ±float64 max instead of reaching ±inf and then NaN)."""
    z = logits.double().clone()
    for row, seq in zip(z, seqs):
        p = seq.params
        if not p.penalises():
            continue
        if p.repetition_penalty != 1.0 and (seq.prompt or seq.output):
            seen = torch.tensor(sorted(set(seq.prompt) | set(seq.output)))
            x = row[seen]
            row[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if seq.output and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(seq.output), minlength=row.numel()).double()
            row -= counts * p.frequency_penalty + (counts > 0).double() * p.presence_penalty
    return torch.nan_to_num(z, nan=-FLOAT64_MAX, posinf=FLOAT64_MAX, neginf=-FLOAT64_MAX) if z.isinf().any() else z


def column(seqs: list[Sequence], name: str) -> torch.Tensor:
    return torch.tensor([[float(getattr(s.params, name))] for s in seqs], dtype=torch.float64)  # [B, 1]


def probabilities(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """[B, V] float64: each row's sampling distribution; one-hot on the argmax for temperature 0.
    Safe for every temperature in (0, 2]: logits are shifted so the largest is 0 before dividing, so
    a tiny T drives the others to -inf (probability 0), never to inf - inf."""
    return distribution(penalised(logits, seqs), seqs)


def distribution(z: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    greedy = column(seqs, "temperature") <= 0
    temperature = torch.where(greedy, 1.0, column(seqs, "temperature"))
    probs = torch.softmax((z - z.max(-1, keepdim=True).values) / temperature, dim=-1)
    probs = truncated(probs, seqs)
    one_hot = torch.zeros_like(probs).scatter_(-1, z.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def truncated(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """top_k, then top_p over what top_k kept, then min_p; each keeps a prefix of the sorted row,
    never less than the top token. Ties at the k-th value are kept (as transformers does)."""
    if not any(s.params.top_k or s.params.top_p < 1 or s.params.min_p for s in seqs):
        return probs  # sorting a 150k vocabulary costs more than the rest of sampling
    sorted_probs, order = torch.sort(probs, descending=True)  # [B, V]
    vocab = probs.shape[-1]
    k = torch.tensor([[s.params.top_k if 0 < s.params.top_k < vocab else vocab] for s in seqs])
    keep = sorted_probs >= sorted_probs.gather(-1, k - 1)
    kept = torch.where(keep, sorted_probs, 0.0)
    kept = kept / kept.sum(-1, keepdim=True)
    top_p = column(seqs, "top_p")
    keep &= (torch.cumsum(kept, -1) - kept < top_p) | (top_p >= 1.0)  # below 1 only: rounding must not drop the tail
    keep &= sorted_probs >= column(seqs, "min_p") * sorted_probs[:, :1]
    keep[:, 0] = True
    out = torch.zeros_like(probs).scatter_(-1, order, torch.where(keep, sorted_probs, 0.0))
    return out / out.sum(-1, keepdim=True)


def sample_batch(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of `logits` [B, V], each drawn with its own sequence's parameters and
    generator; the tokens are appended to each sequence's output."""
    if all(s.params.temperature <= 0 and not s.params.penalises() for s in seqs):  # plain greedy: no copies
        tokens = logits.argmax(-1).tolist()
        for seq, token in zip(seqs, tokens):
            seq.output.append(token)
        return tokens
    z = penalised(logits.cpu(), seqs)  # the generators are CPU generators
    probs = z if all(s.params.temperature <= 0 for s in seqs) else distribution(z, seqs)  # argmax is the same
    tokens = []
    for row, seq in zip(probs, seqs):
        if seq.params.temperature <= 0:
            token = int(row.argmax())
        else:
            token = int(torch.multinomial(row / row.sum(), 1, generator=seq.generator))
        seq.output.append(token)
        tokens.append(token)
    return tokens


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from one row of logits [V] with temperature and top_p only (no history)."""
    seq = Sequence(SamplingParams(temperature=temperature, top_p=top_p), generator=generator)
    return sample_batch(logits[None], [seq])[0]


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely tokens, most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], n: int) -> list[TokenLogprob]:
    """For each row of `logits` [T, V], the model's log-probability of tokens[t] and its n most
    likely alternatives."""
    logp = torch.log_softmax(logits.cpu().double(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    top_v, top_i = logp.topk(min(n, logp.shape[-1]), dim=-1) if n else (logp[:, :0], logp[:, :0].long())
    return [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in zip(tokens, chosen, top_i.tolist(), top_v.tolist())]
