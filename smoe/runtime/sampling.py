"""The sampler: per-sequence parameters over a batch of logits rows, the defaults a model samples
with, and the log-probabilities reported.

Order, as in transformers' and vLLM's pipelines: a logit bias (OpenAI's `logit_bias`, llama.cpp's first
sampler) added to the raw logits, then penalties (repetition, then frequency and presence), then
temperature, then top_k, top_p and min_p; temperature 0 is greedy over the penalised logits. Each row
of a [B, V] logits tensor has its own `SamplingParams`, its own token history and its own random
generator, so sequences of a batch never influence each other.

`SamplingParams` is the one container of sampling settings, from command-line flags or a request
body to the sampler. A model's defaults are the sampling fields its generation_config.json sets,
over llama.cpp's (`model_defaults`); what a user gives replaces them field by field (`chosen`).

Logprobs are the model's log-softmax over the raw logits (what OpenAI reports, and what evaluation
harnesses need for log-likelihood), not of the penalised, tempered or truncated distribution.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from smoe import numeric
from smoe.errors import SmoeError
from smoe.format.jsonfile import parse_json

FLOAT64_MAX = torch.finfo(torch.float64).max


@dataclass(frozen=True)
class SamplingParams:
    """Each field's own default turns its step off (temperature 0: greedy); the settings a model
    samples with unless told otherwise are `model_defaults`."""
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 0 keeps only the most likely token
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # keep tokens of at least min_p times the top token's probability
    repetition_penalty: float = 1.0  # seen tokens' logits divided by it when positive, multiplied when negative
    frequency_penalty: float = 0.0  # logit -= count * frequency_penalty
    presence_penalty: float = 0.0  # logit -= (count > 0) * presence_penalty
    seed: int | None = None  # None: a random one, drawn by `chosen`
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) pairs added to the raw logits

    def penalises(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def as_dict(self) -> dict:
        """The settings as JSON takes them: a logit bias in OpenAI's shape ({"token id": bias}), and only if set."""
        out = asdict(self)
        bias = out.pop("logit_bias")
        return out | ({"logit_bias": {str(token): value for token, value in bias}} if bias else {})

    def line(self) -> str:
        """One line for people: greedy, or the steps that are on, and the seed."""
        if self.temperature <= 0:
            steps = ["greedy"]
        else:
            steps = [f"temperature {self.temperature:g}"] + [
                f"{label} {value:g}" for label, value, off in (
                    ("top-k", self.top_k, 0), ("top-p", self.top_p, 1.0), ("min-p", self.min_p, 0.0))
                if value != off]
        steps += [f"{label} {value:g}" for label, value, off in (
            ("repeat-penalty", self.repetition_penalty, 1.0), ("frequency-penalty", self.frequency_penalty, 0.0),
            ("presence-penalty", self.presence_penalty, 0.0)) if value != off]
        if self.logit_bias:
            steps.append(f"logit bias on {len(self.logit_bias)} token{'s' if len(self.logit_bias) > 1 else ''}")
        return ", ".join(steps) + ("" if self.seed is None else f", seed {self.seed}")


FIELDS = frozenset(f.name for f in fields(SamplingParams))
GREEDY = SamplingParams(seed=0)  # temperature 0 and every other step off: the most likely token each time
# llama.cpp's defaults (common/common.h), for models whose generation_config.json sets no sampling field
LLAMA_CPP_DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
# the generation_config.json keys a model's defaults come from, and the bounds each must meet
GENERATION_CONFIG_FIELDS = {"temperature": numeric.Range(float, 0), "top_k": numeric.TOP_K, "top_p": numeric.TOP_P,
                            "min_p": numeric.MIN_P, "repetition_penalty": numeric.REPETITION_PENALTY}
GENERATION_CONFIG = "generation_config.json"


def model_defaults(generation_config: dict | None, where: str = GENERATION_CONFIG) -> SamplingParams:
    """The sampling fields `generation_config` (a generation_config.json) sets, over llama.cpp's
    defaults; `do_sample: false` is greedy (keeping its repetition penalty, as transformers does).
    A value of the wrong type or out of range is an error naming the file `where` and the key."""
    config = generation_config or {}
    given = {}
    for key, bounds in GENERATION_CONFIG_FIELDS.items():
        value = config.get(key)
        if value is None:  # absent, or null as transformers writes an unset field
            continue
        problem = bounds.problem(value)
        if problem:
            raise SmoeError(f"{where}: {key}: {problem}")
        given[key] = bounds.kind(value)
    if config.get("do_sample") is False:
        return SamplingParams(repetition_penalty=given.get("repetition_penalty", 1.0))
    return replace(LLAMA_CPP_DEFAULTS, **given)


def sampling_defaults(directory) -> SamplingParams:
    """The defaults of the model or vault in `directory`, from its generation_config.json if it has one."""
    return model_defaults(generation_config(directory), str(Path(directory) / GENERATION_CONFIG))


def defaults_origin(directory) -> str:
    """Where `sampling_defaults(directory)` come from, in words."""
    config = generation_config(directory) or {}
    sets = any(config.get(key) is not None for key in (*GENERATION_CONFIG_FIELDS, "do_sample"))
    return f"the model's {GENERATION_CONFIG}" if sets else f"llama.cpp's, as the model's {GENERATION_CONFIG} sets none"


def generation_config(directory) -> dict | None:
    """directory/generation_config.json, or None without one (a vault checked its bytes when opened)."""
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return None
    config = parse_json(path.read_bytes(), path)
    if not isinstance(config, dict):
        raise SmoeError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def generation_config_fields(params: SamplingParams) -> dict:
    """`params` as generation_config.json's fields, so that transformers' generate samples as smoe
    does by default (it has no frequency or presence penalty, and its seed is torch's global one)."""
    if params.temperature <= 0:
        return {"do_sample": False, "repetition_penalty": params.repetition_penalty}
    return {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
            "min_p": params.min_p or None, "repetition_penalty": params.repetition_penalty}


def chosen(defaults: SamplingParams, **given) -> SamplingParams:
    """`defaults` with each given field that is not None in its place, and a random seed when neither
    gives one: the settings a request or a command line asks for."""
    unknown = set(given) - FIELDS
    if unknown:
        raise TypeError(f"not sampling settings: {', '.join(sorted(unknown))}")
    if isinstance(given.get("logit_bias"), dict):  # OpenAI's shape, {token: bias}
        given["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in given["logit_bias"].items()))
    params = replace(defaults, **{k: v for k, v in given.items() if v is not None})
    return params if params.seed is not None else replace(params, seed=random_seed())


def random_seed() -> int:
    return secrets.randbits(63)


@dataclass
class Sequence:
    """One row's parameters and state: the repetition penalty sees prompt and output, frequency and
    presence penalties only the output (as OpenAI and vLLM count them)."""
    params: SamplingParams
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    generator: torch.Generator = None
    # a grammar the output must follow: allowed(width) -> bool [width] of the tokens it allows next,
    # advance(token) after each chosen token
    constraint: object = None

    def __post_init__(self):
        if self.generator is None:
            seed = random_seed() if self.params.seed is None else self.params.seed
            self.generator = torch.Generator().manual_seed(seed % 2**64)  # torch takes seeds in [0, 2**64)

    def chose(self, token: int) -> None:
        self.output.append(token)
        if self.constraint is not None:
            self.constraint.advance(token)


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


def constrained(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """`logits` with -inf on the tokens each row's constraint forbids, before penalties and sampling,
    so that neither greedy nor sampled decoding can leave the grammar."""
    if all(s.constraint is None for s in seqs):
        return logits
    logits = logits.clone()
    for row, seq in zip(logits, seqs):
        if seq.constraint is not None:
            row.masked_fill_(~seq.constraint.allowed(row.numel()).to(row.device), float("-inf"))
    return logits


def biased(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """`logits` plus each row's logit_bias (whoever takes a bias from a user checks its tokens are in the vocabulary)."""
    if all(not s.params.logit_bias for s in seqs):
        return logits
    logits = logits.clone()
    for row, seq in zip(logits, seqs):
        for token, bias in seq.params.logit_bias:
            row[token] += bias
    return logits


def sample_batch(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of `logits` [B, V], each drawn with its own sequence's parameters and
    generator; the tokens are appended to each sequence's output."""
    logits = constrained(biased(logits, seqs), seqs)
    if all(s.params.temperature <= 0 and not s.params.penalises() for s in seqs):  # plain greedy: no copies
        tokens = logits.argmax(-1).tolist()
        for seq, token in zip(seqs, tokens):
            seq.chose(token)
        return tokens
    z = penalised(logits.cpu(), seqs)  # the generators are CPU generators
    probs = z if all(s.params.temperature <= 0 for s in seqs) else distribution(z, seqs)  # argmax is the same
    tokens = []
    for row, seq in zip(probs, seqs):
        if seq.params.temperature <= 0:
            token = int(row.argmax())
        else:
            token = int(torch.multinomial(row / row.sum(), 1, generator=seq.generator))
        seq.chose(token)
        tokens.append(token)
    return tokens


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
