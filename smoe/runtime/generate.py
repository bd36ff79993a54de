"""Token generation over a OpenedVault: sampling, streaming text, and the statistics users see."""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass

import torch

from smoe.errors import SmoeError
from smoe.hf.tokenizer import Detokenizer
from smoe.runtime.decoder import SequenceStep, open_decoder
from smoe.runtime.model import DECODERS
from smoe.runtime.sampling import SamplingParams, Sequence, chosen, sample_batch, sampling_defaults, token_logprobs


@dataclass
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    hits: int
    misses: int
    hit_rate: float
    bytes_read: int
    read_wait_s: float
    peak_rss_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return (f"[{self.prompt_tokens} prompt tokens, TTFT {self.ttft_s * 1000:.0f} ms, prefill {self.prefill_tok_s:.1f} tok/s, "
                f"decode {self.decode_tok_s:.1f} tok/s ({self.generated_tokens} tokens), cache hit rate "
                f"{100 * self.hit_rate:.1f}%, read {self.bytes_read / 1e9:.3f} GB, RSS {self.peak_rss_bytes / 1e9:.2f} GB]")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def eos_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def next_logits_function(sm, positions: int, decoder: str = "auto"):
    """step(new_token_ids) -> logits of the last position, continuing the same sequence."""
    step = logits_function(sm, positions, decoder)
    return lambda ids: step(ids)[-1]


def logits_function(sm, positions: int, decoder: str = "auto"):
    """step(new_token_ids) -> logits [T, V] (on the CPU) of the new positions, continuing one sequence
    through the decoder contract (smoe.runtime.decoder).

    "fast" is the compiled decode step of the families that have one; "generic" runs the model's own
    modules with a KV cache (every family); "auto" is the decoder the vault was opened with."""
    if decoder not in DECODERS:
        raise SmoeError(f"unknown decoder {decoder!r} ({', '.join(DECODERS)})")
    dec = open_decoder(sm, decoder, positions)
    sequence, held = object(), [0]

    def step(ids):
        logits = dec.forward([SequenceStep(sequence, list(ids), held[0])])[0]
        held[0] += len(ids)
        return logits

    return step


@torch.inference_mode()
def generate(sm, prompt_ids: list[int], max_tokens: int = 128, *, params: SamplingParams | None = None,
             on_token=None, decoder: str = "auto", logprobs: int | None = None, on_logprob=None,
             on_prompt_logprobs=None, constraint=None) -> tuple[list[int], GenerationStats]:
    """Prefill the prompt in one forward (each layer reads its experts once), then decode token by token.

    `params`: the sampler's settings (default: the vault's, `sampling_defaults`, with a random seed).
    `on_token(token)` sees each new token; returning False stops generation after it (a server cancels
    a request whose client went away this way). With `logprobs` = n, `on_logprob(TokenLogprob)` sees
    each new token's log-probability and its n most likely alternatives first, and
    `on_prompt_logprobs(list)` those of prompt tokens 1.. (the first has no context to be predicted from)."""
    if not prompt_ids:
        raise SmoeError("empty prompt")
    limit = sm.max_positions
    if limit and len(prompt_ids) + max_tokens > limit:
        raise SmoeError(f"prompt of {len(prompt_ids)} tokens + {max_tokens} new tokens exceeds the model's context of {limit}")
    stats0 = sm.cache_stats()
    seq = Sequence(params or chosen(sampling_defaults(sm.vault.dir)), list(prompt_ids), constraint=constraint)
    stop = eos_ids(sm.model)
    step = logits_function(sm, len(prompt_ids) + max_tokens, decoder)

    def next_token(logits: torch.Tensor) -> int:  # logits [T, V]; the last row predicts the next token
        token = sample_batch(logits[-1:], [seq])[0]
        if logprobs is not None and on_logprob:
            on_logprob(token_logprobs(logits[-1:], [token], logprobs)[0])
        return token

    start = time.perf_counter()
    prefill = step(prompt_ids)
    if logprobs is not None and on_prompt_logprobs:
        on_prompt_logprobs(token_logprobs(prefill[:-1], prompt_ids[1:], logprobs))
    token = next_token(prefill)
    ttft = time.perf_counter() - start
    tokens = [token]
    go_on = not on_token or on_token(token) is not False
    clock = [time.perf_counter()]  # the decode's start, then the end of each step
    while go_on and len(tokens) < max_tokens and token not in stop:
        token = next_token(step([token]))
        tokens.append(token)
        go_on = not on_token or on_token(token) is not False
        clock.append(time.perf_counter())
    # the first step compiles the decode kernels after a fresh install (numba, seconds): timed apart where
    # other steps follow, so the decode rate is the steady one
    timed = clock[1:] if len(clock) > 2 else clock
    return tokens, make_stats(sm, stats0, len(prompt_ids), tokens, ttft, len(timed) - 1, timed[-1] - timed[0])


def make_stats(sm, before: dict, prompt_tokens: int, tokens: list[int], ttft: float, decoded: int,
               decode_s: float) -> GenerationStats:
    """`decoded` steps took `decode_s` (the decode rate's)."""
    now = sm.cache_stats()
    hits, misses = now["hits"] - before["hits"], now["misses"] - before["misses"]
    return GenerationStats(
        prompt_tokens=prompt_tokens, generated_tokens=len(tokens), ttft_s=ttft,
        prefill_tok_s=prompt_tokens / ttft if ttft else 0.0,
        decode_tok_s=decoded / decode_s if decoded and decode_s else 0.0,
        hits=hits, misses=misses, hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        bytes_read=now["bytes_read"] - before["bytes_read"],
        read_wait_s=now["wait_seconds"] - before["wait_seconds"], peak_rss_bytes=peak_rss_bytes(),
    )


class TextStreamer:
    """Prints decoded text as tokens arrive (the detokenizer holds back an incomplete multi-byte character)."""

    def __init__(self, tokenizer, out):
        self.detokenizer, self.out = Detokenizer(tokenizer), out

    @property
    def tokens(self) -> list[int]:
        return self.detokenizer.tokens

    def __call__(self, token: int) -> None:
        piece = self.detokenizer.push(token)
        if piece:
            self.out.write(piece)
            self.out.flush()
