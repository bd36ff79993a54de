"""`smoe bench runtime`: decode speed, hit rate, bytes read and peak RSS of the streaming runtime on
CPU, for several expert-cache budgets, cold (page cache dropped) — each configuration in its own
process so peak RSS is its own — next to baselines run in the same invocation."""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.safetensors_io import write_safetensors
from smoe.format.vault import DATA_FILE, TRUNK_FILE, QuantisedTensor, Vault, VaultWriter
from smoe.switches import CPU_COMPILED

PROMPT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
          "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light,")


def drop_page_cache(path: Path) -> float | None:
    """Evict a file from the page cache so the next reads come from the disk (a cold run). Returns the share of
    its pages still resident afterwards (resident_fraction): about 0 where the drop worked; a filesystem with no
    disk behind it (tmpfs) keeps every page, and one that refuses the advice keeps what it had."""
    fd = os.open(path, os.O_RDONLY)
    try:  # a refusal of either is not an error here: what stays resident is measured below
        with contextlib.suppress(OSError):
            os.fsync(fd)  # dirty pages are not dropped
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_fraction(path)


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def resident_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache: mincore(2) over a read-only shared mapping of it (the
    mapping itself reads nothing). None where the system has no mincore."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")


def memory_cgroup(limit_bytes: int) -> Path:
    """A memory cgroup capped at limit_bytes (page cache included, so an mmap cannot lean on it)."""
    v1 = CGROUP_V1 / "memory.limit_in_bytes"
    base = CGROUP_V1 if v1.exists() else CGROUP_V2
    group = base / f"smoe-bench-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        limit_file = "memory.limit_in_bytes" if base == CGROUP_V1 else "memory.max"
        (group / limit_file).write_text(str(limit_bytes))
    except OSError as e:
        raise SmoeError(f"cannot create a memory cgroup under {base} ({e}); run as root on a cgroup-enabled system") from None
    return group


def child(code: str, *args, memory_limit: int | None = None, env: dict | None = None) -> dict:
    """Run `code` in a fresh interpreter (its own peak RSS, no warm caches), optionally inside a
    memory cgroup and with extra environment variables; it prints one JSON line."""
    join = None
    if memory_limit:
        procs = memory_cgroup(memory_limit) / "cgroup.procs"
        join = lambda: procs.write_text(str(os.getpid()))
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, preexec_fn=join,
                          env=os.environ | (env or {}))
    if proc.returncode != 0:
        raise SmoeError(f"benchmark child failed: {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


STREAMING_RUN = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[5]))
from smoe.runtime.model import OpenedVault
from smoe.runtime.generate import generate
from smoe.runtime.sampling import GREEDY
from transformers import AutoTokenizer
vault, cache, tokens, dtype, _, decoder, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:8]
kernel_path = sys.argv[8] if len(sys.argv) > 8 else "auto"
sm = OpenedVault(vault, dtype=dtype, cache_bytes=cache, kernel_path=kernel_path)
ids = AutoTokenizer.from_pretrained(vault)(prompt)["input_ids"]
out, stats = generate(sm, ids, max_tokens=tokens, decoder=decoder, params=GREEDY)  # as the baselines
print(json.dumps(stats.as_dict() | {"expert_bytes_cached_max": sm.store.cache_bytes}))
"""

TRANSFORMERS_RUN = """
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).eval()
ids = AutoTokenizer.from_pretrained(sys.argv[1])(sys.argv[4], return_tensors="pt")["input_ids"]
n = int(sys.argv[2])
model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
t = time.perf_counter()
out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
dt = time.perf_counter() - t
print(json.dumps({"decode_tok_s": (out.shape[1] - ids.shape[1]) / dt}))
"""

LLAMA_CPP_RUN = """
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[3]), verbose=False, logits_all=False)
n = int(sys.argv[2])
toks = llm.tokenize(sys.argv[4].encode())
llm.eval(toks)
t = time.perf_counter()
tok = llm.sample(temp=0.0)
for _ in range(n - 1):
    llm.eval([tok])
    tok = llm.sample(temp=0.0)
dt = time.perf_counter() - t
print(json.dumps({"decode_tok_s": (n - 1) / dt}))
"""


def prepared_expert_bytes(vault_dir: Path, dtype: str) -> int:
    """What all experts take in the cache once prepared for compute."""
    from smoe.format.dtypes import TORCH_NAMES
    from smoe.runtime.cpu import kernels as kernels_cpu
    from smoe.runtime.cpu.store import ExpertStore

    def prepare(tensors, biases):
        prepared = kernels_cpu.prepare_expert(tensors, biases, TORCH_NAMES[dtype], fuse=True)
        return prepared, prepared.nbytes

    with Vault(vault_dir) as vault:
        store = ExpertStore(vault, 0, prepare)
        try:
            return int(sum(e.size for e in vault.entries.values()) * store.prepare_ratio())
        finally:
            store.close()


def bench_model(vault: str, ref: str | None, gguf: str | None, budgets: list[float], tokens: int, dtype: str,
                threads: int, decoder: str, memory_limit_gb: float | None = None) -> dict:
    """Each budget cold, in its own process; with a memory limit every decoder runs in the same cgroup
    cap, so llama.cpp's mmap cannot lean on the page cache beyond it."""
    vault_dir = Path(vault)
    total = prepared_expert_bytes(vault_dir, dtype)
    limit = int(memory_limit_gb * 1e9) if memory_limit_gb else None
    rows = []
    for fraction in budgets:
        drop_page_cache(vault_dir / DATA_FILE)
        r = child(STREAMING_RUN, vault_dir, int(total * fraction), tokens, dtype, threads, decoder, PROMPT, memory_limit=limit)
        rows.append(r | {"budget_fraction": fraction, "read_gbps": r["bytes_read"] / max(r["read_wait_s"], 1e-9) / 1e9})
    result = {"benchmark": "runtime", "vault": vault, "dtype": dtype, "decoder": decoder, "threads": threads,
              "tokens": tokens, "prepared_expert_bytes": total, "rows": rows, "baselines": {},
              "memory_limit_gb": memory_limit_gb}
    if decoder in ("auto", "fast") and not limit:
        # the fast CPU decoder before the compiled step: eager torch ops, experts in torch's int4 form
        # (bf16; the dequant form otherwise), every expert cached
        old_path = "int4" if dtype == "bfloat16" else "dequant"
        result["baselines"]["lean_eager"] = child(STREAMING_RUN, vault_dir, total * 4, tokens, dtype, threads, decoder,
                                                  PROMPT, old_path, env={CPU_COMPILED.name: "0"})
    if ref and not limit:
        result["baselines"]["transformers_bf16_resident"] = child(TRANSFORMERS_RUN, ref, tokens, threads, PROMPT)
    if gguf:
        drop_page_cache(Path(gguf))
        run = child(LLAMA_CPP_RUN, gguf, tokens, threads, PROMPT, memory_limit=limit)
        result["baselines"]["llama_cpp"] = run | {"gguf": gguf}
    return result


# --- a synthetic vault of real expert shapes, with skewed routing --------------------------------

SYNTH = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}  # Qwen3-30B-A3B experts


def write_synthetic_vault(path: Path, layers: int, bits: int = 4) -> None:
    """Random codes and plausible scales, one blob per expert; enough for read and compute timings."""
    rng = np.random.default_rng(0)
    writer = VaultWriter(path, bits)
    h, i = SYNTH["hidden"], SYNTH["inter"]
    for layer in range(layers):
        for e in range(SYNTH["experts"]):
            shapes = (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))
            tensors = [random_tensor(rng, role, shape, bits) for role, shape in shapes]
            if (layer, e) not in writer.done():
                writer.add(layer, e, tensors)
    write_safetensors(path / TRUNK_FILE, [], lambda n: None)
    writer.finish({"family": "synthetic", "model_type": "qwen3_moe", "moe_layers": list(range(layers)),
                   "num_experts": SYNTH["experts"], "top_k": SYNTH["top_k"], "roles": ["gate", "up", "down"],
                   "expert_shapes": {"gate": [i, h], "up": [i, h], "down": [h, i]}})


def random_tensor(rng, role: str, shape: tuple[int, int], bits: int) -> QuantisedTensor:
    code_bytes, _ = codec.encoded_nbytes(shape[0] * shape[1], bits)
    groups = shape[0] * shape[1] // codec.GROUP_SIZE
    codes = torch.from_numpy(rng.integers(0, 256, code_bytes, dtype=np.uint8)).view(groups, -1)
    scales = torch.from_numpy(rng.uniform(0.01, 0.05, groups).astype(np.float16))
    return QuantisedTensor(role, shape, bits, codes, scales)


def skewed_routing(layers: int, tokens: int, seed: int = 0, zipf: float = 1.2, experts: int = SYNTH["experts"],
                   top_k: int = SYNTH["top_k"]) -> np.ndarray:
    """[tokens, layers, top_k] expert ids drawn without replacement from a Zipf-like popularity,
    a different popularity order per layer (real routers are skewed; uniform_routing is the worst
    case for a cache)."""
    rng = np.random.default_rng(seed)
    e, k = experts, top_k
    weights = 1.0 / np.arange(1, e + 1) ** zipf
    weights /= weights.sum()
    order = [rng.permutation(e) for _ in range(layers)]
    out = np.empty((tokens, layers, k), dtype=np.int64)
    for t in range(tokens):
        for layer in range(layers):
            out[t, layer] = order[layer][rng.choice(e, size=k, replace=False, p=weights)]
    return out


def uniform_routing(layers: int, tokens: int, seed: int = 0, experts: int = SYNTH["experts"],
                    top_k: int = SYNTH["top_k"]) -> np.ndarray:
    """[tokens, layers, top_k] expert ids: k distinct experts per token and layer, every k-subset equally
    likely (the ordering of i.i.d. uniform keys). No expert is more popular than another, so an LRU cache of
    a fraction f of the experts hits about f of the time: the worst case for a cache."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :top_k].astype(np.int64)


ROUTINGS = {"zipf": skewed_routing, "uniform": uniform_routing}


def routing_draw(kind: str, layers: int, tokens: int, seed: int = 0, experts: int = SYNTH["experts"],
                 top_k: int = SYNTH["top_k"]) -> np.ndarray:
    """[tokens, layers, top_k] expert ids of the routing `kind` ("zipf" or "uniform")."""
    if kind not in ROUTINGS:
        raise SmoeError(f"routing {kind!r}: one of {', '.join(ROUTINGS)}")
    return ROUTINGS[kind](layers, tokens, seed=seed, experts=experts, top_k=top_k)


SYNTHETIC_RUN = """
import json, sys, time, resource, numpy as np, torch
torch.set_num_threads(1)
import torch.nn.functional as F
from smoe.runtime.cpu import kernels as kernels_cpu
from smoe.runtime.cpu.store import ExpertStore
from smoe.format.vault import Vault
vault, cache, routing, prefetch = Vault(sys.argv[1]), int(sys.argv[2]), np.load(sys.argv[3]), sys.argv[4] == "1"
prepare = lambda t, b: (lambda p: (p, p.nbytes))(kernels_cpu.prepare_expert(t, b, torch.bfloat16, fuse=True))
store = ExpertStore(vault, cache, prepare)
x = torch.randn(1, 2048, dtype=torch.bfloat16) * 0.1
def mlp(e, h):
    gate, up = kernels_cpu.gate_and_up(h, e)
    return kernels_cpu.linear(F.silu(gate) * up, e, "down")
t0 = time.perf_counter()
for t in range(routing.shape[0]):
    for layer in range(routing.shape[1]):
        if prefetch and layer + 1 < routing.shape[1]:
            store.prefetch(layer + 1, routing[t, layer + 1].tolist())
        got = store.get(layer, routing[t, layer].tolist())
        y = sum(mlp(p, x) for p in got.values())
dt = time.perf_counter() - t0
s = store.stats.as_dict()
print(json.dumps(s | {"tok_s": routing.shape[0] / dt, "seconds": dt,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def disk_read_gbps(path: Path, block: int = 64 << 20) -> float:
    """Cold sequential read bandwidth of the file (page cache dropped first)."""
    drop_page_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size, done, t = os.fstat(fd).st_size, 0, time.perf_counter()
        while done < size:
            done += len(os.pread(fd, min(block, size - done), done))
        return done / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def bench_synthetic(workdir: str, layers: int, tokens: int, budgets: list[float], prefetch_modes=(False, True)) -> dict:
    root = Path(workdir)
    vault_dir = root / f"synthetic-q4-{layers}L"
    if not (vault_dir / "index.json").exists():
        write_synthetic_vault(vault_dir, layers)
    routing = skewed_routing(layers, tokens)
    np.save(root / "routing.npy", routing)
    with Vault(vault_dir) as v:
        blob_bytes = sum(e.size for e in v.entries.values())
    disk = disk_read_gbps(vault_dir / DATA_FILE)
    # int4-prepared experts hold codes + bf16 scale/zero pairs: about 1.06x the blob bytes
    total = int(blob_bytes * 1.06)
    rows = []
    for fraction in budgets:
        for prefetch in prefetch_modes:
            drop_page_cache(vault_dir / DATA_FILE)
            r = child(SYNTHETIC_RUN, vault_dir, int(total * fraction), root / "routing.npy", int(prefetch))
            miss_seconds_limit = r["bytes_read"] / (disk * 1e9)
            rows.append(r | {"budget_fraction": fraction, "prefetch": prefetch,
                             "bytes_per_token": r["bytes_read"] / tokens,
                             "disk_limit_tok_s": tokens / miss_seconds_limit if miss_seconds_limit else None})
    return {"benchmark": "runtime-synthetic", "vault_gb": blob_bytes / 1e9, "layers": layers, "tokens": tokens,
            "disk_gbps_cold_sequential": disk, "rows": rows}


def format_result(r: dict) -> str:
    lines = []
    if r["benchmark"] == "runtime":
        lines.append(f"{r['vault']}: {r['tokens']} tokens greedy, {r['dtype']}, decoder {r['decoder']}, "
                     f"{r['threads']} thread(s); all experts prepared = {r['prepared_expert_bytes'] / 1e6:.1f} MB"
                     + (f"; memory limit {r['memory_limit_gb']} GB (cgroup)" if r.get("memory_limit_gb") else ""))
        for row in r["rows"]:
            lines.append(f"  budget {100 * row['budget_fraction']:5.1f}%  decode {row['decode_tok_s']:7.1f} tok/s  "
                         f"prefill {row['prefill_tok_s']:7.1f} tok/s  hit rate {100 * row['hit_rate']:5.1f}%  "
                         f"read {row['bytes_read'] / 1e6:8.1f} MB  peak RSS {row['peak_rss_bytes'] / 1e9:.2f} GB")
        for name, b in r["baselines"].items():
            best = max(row["decode_tok_s"] for row in r["rows"])
            lines.append(f"  baseline {name}: {b['decode_tok_s']:.1f} tok/s  "
                         f"(smoe best / baseline = {best / b['decode_tok_s']:.2f})")
    else:
        lines.append(f"synthetic vault {r['vault_gb']:.2f} GB ({r['layers']} layers of Qwen3-30B-A3B experts, Q4), "
                     f"{r['tokens']} tokens, cold sequential disk read {r['disk_gbps_cold_sequential']:.2f} GB/s")
        for row in r["rows"]:
            limit = row["disk_limit_tok_s"]
            lines.append(f"  budget {100 * row['budget_fraction']:5.1f}% prefetch {'on ' if row['prefetch'] else 'off'}  "
                         f"{row['tok_s']:7.2f} tok/s  hit {100 * row['hit_rate']:5.1f}%  "
                         f"{row['bytes_per_token'] / 1e6:7.1f} MB/token  RSS {row['peak_rss_bytes'] / 1e9:.2f} GB"
                         + (f"  disk limit {limit:.2f} tok/s ({100 * row['tok_s'] / limit:.0f}%)" if limit else ""))
    return "\n".join(lines)
