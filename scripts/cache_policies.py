"""Hit rates of cache eviction policies on a vault's real routing (a replay, no timing).

Usage: python scripts/cache_policies.py VAULT TEXT_FILE [--tokens 1024]

Runs the vault on the first tokens of the text (one token at a time, as decoding does), records
which experts each layer asks the store for, then replays that trace through LRU (the store's
policy), 2Q (a FIFO for first uses, LRU for experts seen twice) and LFU (evict the least used so
far) at cache budgets counted in experts.
"""

import argparse
from collections import Counter, OrderedDict

import torch
from transformers import AutoTokenizer

from smoe.runtime.model import OpenedVault
from smoe.source.text import token_stream


def record(vault: str, text: str, tokens: int) -> list[tuple[int, int]]:
    sm = OpenedVault(vault, dtype="float32")
    ids = token_stream(AutoTokenizer.from_pretrained(vault), text, tokens)
    trace, get = [], sm.store.get
    sm.store.get = lambda layer, experts: (trace.extend((layer, e) for e in dict.fromkeys(experts)), get(layer, experts))[1]
    dec = sm.fast_decoder(len(ids) + 1)
    with torch.inference_mode():
        for t in ids:
            dec.forward([t])
    return trace


def lru(trace, capacity: int) -> float:
    cache, hits = OrderedDict(), 0
    for key in trace:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            cache[key] = True
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / len(trace)


def two_q(trace, capacity: int, first_share: float = 0.25) -> float:
    first, frequent, ghosts, hits = OrderedDict(), OrderedDict(), OrderedDict(), 0
    first_cap = max(1, int(capacity * first_share))
    for key in trace:
        if key in frequent:
            hits += 1
            frequent.move_to_end(key)
        elif key in first:
            hits += 1
        else:
            if key in ghosts:  # seen before, evicted from the FIFO: it is used again, keep it longer
                del ghosts[key]
                frequent[key] = True
            else:
                first[key] = True
            while len(first) + len(frequent) > capacity:
                if len(first) > first_cap or not frequent:
                    ghosts[first.popitem(last=False)[0]] = True
                    if len(ghosts) > capacity:
                        ghosts.popitem(last=False)
                else:
                    frequent.popitem(last=False)
    return hits / len(trace)


def lfu(trace, capacity: int) -> float:
    counts, cache, hits = Counter(), set(), 0
    for key in trace:
        counts[key] += 1
        if key in cache:
            hits += 1
            continue
        cache.add(key)
        if len(cache) > capacity:
            cache.remove(min((k for k in cache if k != key), key=counts.__getitem__))
    return hits / len(trace)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("vault")
    p.add_argument("text")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--budgets", default="0.05,0.1,0.25,0.5")
    args = p.parse_args()
    trace = record(args.vault, args.text, args.tokens)
    experts = len({key for key in trace})
    print(f"{len(trace)} expert requests over {args.tokens} tokens, {experts} distinct experts")
    print("| budget | experts held | LRU | 2Q | LFU |\n|---|---|---|---|---|")
    for fraction in (float(b) for b in args.budgets.split(",")):
        capacity = max(1, int(experts * fraction))
        print(f"| {fraction:.0%} | {capacity} | {lru(trace, capacity):.1%} | {two_q(trace, capacity):.1%} | "
              f"{lfu(trace, capacity):.1%} |")


if __name__ == "__main__":
    main()
