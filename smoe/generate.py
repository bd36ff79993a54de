"""Token generation over a StreamingModel: sampling, streaming text, and the statistics users see."""

from __future__ import annotations

import inspect
import resource
import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from smoe.errors import SmoeError


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


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0; otherwise nucleus sampling over softmax(logits / T). Safe for every
    T in (0, 2] and top_p in [0, 1]: logits are shifted so the largest is 0 before dividing, so a tiny
    T drives the others to -inf (probability 0), never to inf - inf; top_p 0 keeps the top token."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    z = logits.double()  # float64: a T of 1e-300 is not rounded to 0 (0 / 0 would be NaN)
    probs = torch.softmax((z - z.max()) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        keep[0] = True
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def eos_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def cache_keyword(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); accept either release."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


ENGINES = ("auto", "lean", "transformers")


def next_logits_function(sm, positions: int, engine: str = "auto"):
    """step(new_token_ids) -> logits of the last position, continuing the same sequence.

    "lean" is the fast path for the families that have one; "transformers" runs the model's own
    modules with a DynamicCache (every family); "auto" picks lean where it exists."""
    if engine not in ENGINES:
        raise SmoeError(f"unknown engine {engine!r} ({', '.join(ENGINES)})")
    lean = sm.lean_decoder(positions) if engine != "transformers" else None
    if engine == "lean" and lean is None:
        raise SmoeError(f"no lean decode path for the {sm.vault.meta['family']} family (use --engine transformers)")
    if lean is not None:
        return lambda ids: lean.forward(ids)[-1]
    kv = {cache_keyword(sm.model): DynamicCache(config=sm.model.config)}

    def step(ids):
        return sm.model(input_ids=torch.tensor([ids]), use_cache=True, **kv).logits[0, -1]

    return step


@torch.inference_mode()
def generate(sm, prompt_ids: list[int], max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, on_token=None, engine: str = "auto") -> tuple[list[int], GenerationStats]:
    """Prefill the prompt in one forward (each layer reads its experts once), then decode token by token.

    `on_token(token)` sees each new token; returning False stops generation after it (a server
    cancels a request whose client went away this way)."""
    if not prompt_ids:
        raise SmoeError("empty prompt")
    limit = sm.max_positions
    if limit and len(prompt_ids) + max_tokens > limit:
        raise SmoeError(f"prompt of {len(prompt_ids)} tokens + {max_tokens} new tokens exceeds the model's context of {limit}")
    stats0 = sm.cache_stats()
    generator = torch.Generator().manual_seed(seed)
    stop = eos_ids(sm.model)
    step = next_logits_function(sm, len(prompt_ids) + max_tokens, engine)
    start = time.perf_counter()
    token = sample(step(prompt_ids), temperature, top_p, generator)
    ttft = time.perf_counter() - start
    tokens = [token]
    go_on = not on_token or on_token(token) is not False
    decode_start = time.perf_counter()
    while go_on and len(tokens) < max_tokens and token not in stop:
        token = sample(step([token]), temperature, top_p, generator)
        tokens.append(token)
        go_on = not on_token or on_token(token) is not False
    decode_s = time.perf_counter() - decode_start
    return tokens, make_stats(sm, stats0, len(prompt_ids), tokens, ttft, decode_s)


def make_stats(sm, before: dict, prompt_tokens: int, tokens: list[int], ttft: float, decode_s: float) -> GenerationStats:
    now = sm.cache_stats()
    hits, misses = now["hits"] - before["hits"], now["misses"] - before["misses"]
    decoded = len(tokens) - 1
    return GenerationStats(
        prompt_tokens=prompt_tokens, generated_tokens=len(tokens), ttft_s=ttft,
        prefill_tok_s=prompt_tokens / ttft if ttft else 0.0,
        decode_tok_s=decoded / decode_s if decoded and decode_s else 0.0,
        hits=hits, misses=misses, hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        bytes_read=now["bytes_read"] - before["bytes_read"],
        read_wait_s=now["wait_seconds"] - before["wait_seconds"], peak_rss_bytes=peak_rss_bytes(),
    )


class TextStreamer:
    """Prints decoded text as tokens arrive (decoding the whole suffix keeps multi-byte characters intact)."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out, self.tokens, self.printed = tokenizer, out, [], ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text
