"""`smoe bench decode`: GPU decode speed of a Qwen3-30B-A3B-shaped vault under GPU cache budgets.

Everything is built in the run: a vault of random codes with the real model's expert shapes (48
layers x 128 experts of [768, 2048] / [2048, 768], ~16 GB at Q4) and a random bf16 trunk of the real
shapes. Speed does not depend on the values, but hit rates depend on routing, and a random trunk
routes almost uniformly: the experts used are therefore replayed from a recorded draw, while the
router still runs and its top-k is still read by the host, as in real decoding. The draw is skewed
(Zipf, as real routers are) or uniform (`--routing uniform`: no expert more popular than another, the
worst case for a cache); each row is labelled with its routing.

For each row: tok/s, GPU hit rate, bytes moved per token, and the ratio to the physical limit

    limit seconds per token = bytes copied to the GPU / source bandwidth (pinned copy or disk)
                            + bytes the GPU reads (trunk, the k experts of every layer, KV) / HBM bandwidth

and to the I/O limit alone (the first term: what moving the row's measured miss bytes over the link, or
reading them from the disk, allows), with the bandwidths measured in the same run. The disk is measured
as the cache reads it: one request per expert blob, as many in flight as the cache has reader threads.
A disk row is cold: experts.bin is dropped from the page cache before it is timed (the share of its pages
still resident is reported) and read with O_DIRECT where the filesystem allows; where neither gives a
cold state the row says so instead of a percentage. After a disk row its own reads are read again from a
dropped page cache with as many in flight and nothing else to do (`reread`): the rate the disk allowed for
exactly those reads, just after the row, a limit it cannot pass the way it can pass a probe of other blobs taken
minutes apart on a disk whose rate moves. The baseline is transformers running the same model
resident in bf16 on the same GPU.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, is_dataclass
from pathlib import Path
from queue import SimpleQueue

import numpy as np
import torch

from smoe.bench.runtime import ROUTINGS, drop_page_cache, resident_fraction, routing_draw
from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.safetensors_io import write_safetensors
from smoe.format.vault import DATA_FILE, TRUNK_FILE, QuantisedTensor, Vault, VaultWriter

QWEN3_30B = {  # Qwen3-30B-A3B's config.json, text part
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "norm_topk_prob": True,
    "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
    "sliding_window": None, "use_sliding_window": False, "hidden_act": "silu", "bos_token_id": 151643,
    "eos_token_id": 151645, "dtype": "bfloat16",
}


# DeepSeek-V2-Lite's sizes (27 layers, the first dense; 64 experts of 2048 x 1408, top 6, 2 shared; MLA with
# kv_lora_rank 512 and no query low rank; its YaRN rope) written as a deepseek_v3 config: sigmoid scores with a
# correction bias, 8 groups of which 4 are used, routed scaling.
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "first_k_dense_replace": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "num_experts_per_tok": 6,
    "n_shared_experts": 2, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "head_dim": 64, "rope_interleave": True, "vocab_size": 102400, "max_position_embeddings": 163840,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 100000,
    "eos_token_id": 100001, "dtype": "bfloat16",
}
# Mixtral-8x7B's config.json: 8 experts of 4096 x 14336, top 2, no shared expert (the layout the Qwen3 shapes
# do not cover: few, wide experts).
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "hidden_act": "silu", "router_aux_loss_coef": 0.02, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
}
MODELS = {"qwen3-30b-a3b": QWEN3_30B, "deepseek-v2-lite": DEEPSEEK_V2_LITE, "mixtral-8x7b": MIXTRAL_8X7B}


# --- building the model --------------------------------------------------------------------------


def random_trunk_tensor(name: str, shape, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Norm weights (and routing biases) 1, matrices N(0, 0.02): activations stay in a sane range through
    48 layers."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def write_model_vault(path: Path, cfg: dict = QWEN3_30B, bits: int = 4, progress: bool = True) -> Path:
    """A vault of random expert codes and a random trunk (every tensor the model of `cfg` loads), with the
    config of `cfg`."""
    import json

    from smoe.hf.model import trunk_shapes
    from smoe.progress import bar
    from smoe.source.description import describe_model

    path = Path(path)
    if (path / "index.json").exists():
        return path
    d = describe_model(cfg)
    h, inter, experts = d.hidden_size, d.experts.intermediate_size, d.routing.num_experts
    writer = VaultWriter(path, bits)
    # one block of random bytes, read at a different offset per expert: random-looking codes at disk speed
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, 64 << 20, dtype=np.uint8)
    shapes = (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter)))
    done = writer.done()
    for layer in bar(d.moe_layers, progress, desc="experts", unit="layer"):
        for e in range(experts):
            if (layer, e) in done:
                continue
            tensors = []
            for role, shape in shapes:
                n_codes, _ = codec.encoded_nbytes(shape[0] * shape[1], bits)
                start = int(rng.integers(0, noise.size - n_codes))
                groups = shape[0] * shape[1] // codec.GROUP_SIZE
                codes = torch.from_numpy(noise[start:start + n_codes].copy()).view(groups, -1)
                scales = torch.from_numpy(rng.uniform(0.01, 0.05, groups).astype(np.float16))
                tensors.append(QuantisedTensor(role, shape, bits, codes, scales))
            writer.add(layer, e, tensors)
    specs = trunk_shapes(cfg)
    write_safetensors(path / TRUNK_FILE, [(n, dtype, shape) for n, (shape, dtype) in specs.items()],
                      lambda name: random_trunk_tensor(name, *specs[name]))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    writer.finish({"family": d.family, "model_type": d.model_type, "moe_layers": list(d.moe_layers),
                   "num_experts": experts, "top_k": d.routing.top_k, "roles": ["gate", "up", "down"],
                   "expert_shapes": {"gate": [inter, h], "up": [inter, h], "down": [h, inter]},
                   "encoder": "random", "source": {"path": "synthetic", "formats": ["random"]}})
    return path


# --- the machine's limits ------------------------------------------------------------------------


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def pinned_copy_gbps(device, nbytes: int = 1 << 30) -> float:
    """Host -> device copies from pinned memory (on a CPU "device", the memory copy the cache makes instead)."""
    cuda = torch.device(device).type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=cuda)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=cuda)
    synchronize(device)
    return 3 * nbytes / (time.perf_counter() - start) / 1e9


def hbm_gbps(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy: bytes read + bytes written per second."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    synchronize(device)
    return 5 * 2 * nbytes / (time.perf_counter() - start) / 1e9


COLD_RESIDENT_MAX = 0.01  # share of experts.bin's pages that may stay in the page cache after a drop for reads to count as cold


def direct_io_works(vault_dir: Path) -> bool:
    """Whether the filesystem holding the vault lets its data be opened with O_DIRECT (as the cache's direct_io)."""
    from smoe.runtime.blobs import open_direct

    with Vault(vault_dir) as v:
        try:
            os.close(open_direct(v))
        except SmoeError:
            return False
    return True


def cold_state(direct_io: bool, resident: float | None) -> dict:
    """Whether reads after a page-cache drop that left `resident` of the file's pages come from the disk: where the
    drop emptied the page cache (a filesystem whose pages cannot be dropped, as tmpfs, has no disk behind it, and
    O_DIRECT there reads memory too); where the page cache cannot be inspected, only with O_DIRECT. `cold_note`
    says why not."""
    cold = resident <= COLD_RESIDENT_MAX if resident is not None else direct_io
    note = None
    if not cold and resident is None:
        note = "not cold: the page cache cannot be inspected (no mincore) and the filesystem refuses direct I/O"
    elif not cold:
        note = (f"not cold: {100 * resident:.1f}% of {DATA_FILE}'s pages stayed in the page cache after the drop"
                + (" (a filesystem with no disk behind it: O_DIRECT reads its memory)" if direct_io
                   else " and the filesystem refuses direct I/O"))
    return {"direct_io": direct_io, "resident_after_drop": resident, "cold": cold, "cold_note": note}


def disk_read(vault_dir: Path, threads: int = 16, n_blobs: int = 512, direct_io: bool | None = None) -> dict:
    """The disk as the expert cache reads it (read_blobs): `n_blobs` whole blobs spread over the whole file."""
    with Vault(vault_dir) as v:
        entries = list(v.entries.values())[:: max(1, len(v.entries) // n_blobs)][:n_blobs]
    return read_blobs(vault_dir, entries, threads, direct_io)


def read_blobs(vault_dir: Path, entries: list, threads: int = 16, direct_io: bool | None = None) -> dict:
    """Reads of whole blobs (vault entries, in this order), as the expert cache issues them: one request per blob
    (its length aligned up to the vault's alignment), `threads` of them in flight from a pool of that many threads,
    nothing else to do. O_DIRECT where the filesystem allows it (direct_io None: try), else buffered preads; the
    file is dropped from the page cache first, and the cold state (cold_state) is part of the result."""
    from smoe.format.vault import align
    from smoe.runtime.blobs import open_direct
    from smoe.runtime.cuda.cache import allocate

    path = vault_dir / DATA_FILE
    if direct_io is None:
        direct_io = direct_io_works(vault_dir)
    resident = drop_page_cache(path)
    with Vault(vault_dir) as v:
        size = align(max(e.size for e in entries), v.alignment)
        buf = allocate(threads * size, torch.device("cpu"), "read buffers", "--threads").view(threads, size)
        free: SimpleQueue = SimpleQueue()  # one buffer per read in flight
        for i in range(threads):
            free.put(memoryview(buf[i].numpy()))
        fd = open_direct(v) if direct_io else v.fd
        try:
            def read(e):
                b = free.get()
                try:
                    return os.preadv(fd, [b[: align(e.size, v.alignment) if direct_io else e.size]], e.offset)
                finally:
                    free.put(b)

            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                total = sum(pool.map(read, entries))
            seconds = time.perf_counter() - start
        finally:
            if direct_io:
                os.close(fd)
    return {"gbps": total / seconds / 1e9, "seconds": seconds, "request_bytes": size, "threads": threads,
            "reads": len(entries), "bytes": total} | cold_state(direct_io, resident)


def disk_gbps(vault_dir: Path, threads: int = 16, n_blobs: int = 512) -> float:
    """GB/s of disk_read."""
    return disk_read(vault_dir, threads, n_blobs)["gbps"]


# --- one run -------------------------------------------------------------------------------------


def decode_run(sm, budget_fraction: float, source: str, routing: np.ndarray, warmup: int, tokens: int,
               threads: int, device: str = "cuda", routing_name: str = "zipf", direct_io: bool = True,
               misses: str = "in-place", repeats: int = 1) -> dict:
    """Decode with the GPU cache at `budget_fraction` of the experts; misses from the pinned host tier
    (source "host", filled before timing; misses "in-place": read there by the kernels, "copy": copied into
    the GPU cache first) or from the disk (source "disk": page cache dropped after the warm-up, O_DIRECT unless
    direct_io is False; the cold state is part of the row). `repeats` spans of `tokens` are timed one after the
    other (as llama-bench's -r): `tok_s` is their mean rate, `tok_s_sd` the spread; the counts cover them all."""
    from smoe.bench.replay import ReplayDecoder, replay
    from smoe.runtime.cuda.cache import blob_slot_bytes

    vault, device = sm.vault, torch.device(device)
    everything = blob_slot_bytes(vault) * len(vault.entries)
    host = everything if source == "host" and budget_fraction < 1 else 0
    timed = tokens * repeats
    dec = ReplayDecoder(sm, device, int(everything * budget_fraction), warmup + timed + 8, host_cache_bytes=host,
                        threads=threads, direct_io=source == "disk" and direct_io,
                        route_replay=torch.from_numpy(routing), in_place=misses == "in-place")
    try:
        if host:
            dec.cache.fill_host()
        token, _ = replay(dec, range(warmup))
        cold = {}
        if source == "disk":
            cold = cold_state(direct_io, drop_page_cache(vault.dir / DATA_FILE))
            dec.cache.reader.log = []  # the row's reads, read again after it (reread)
        dec.account()
        before = dict(dec.cache.stats.as_dict())
        timing0 = dict(dec.timing)
        rates = []
        for start in range(warmup, warmup + timed, tokens):
            token, seconds = replay(dec, range(start, start + tokens), token)
            rates.append(tokens / seconds)
        if source == "disk":  # what the row's own reads left in the page cache (none with O_DIRECT)
            cold["resident_after_row"] = resident_fraction(vault.dir / DATA_FILE)
            cold["reread"] = reread(vault.dir, dec.cache.reader, timed)
        dec.account()
        after = dec.cache.stats.as_dict()
        delta = {k: after[k] - before[k] for k in ("hits", "misses", "host_hits", "bytes_read", "bytes_copied",
                                                   "bytes_in_place", "wait_seconds")}
        rate = float(np.mean(rates))
        return delta | cold | {
            "budget_fraction": budget_fraction, "source": source, "routing": routing_name, "tokens": timed,
            "repeats": repeats, "misses_read": misses_read(dec),
            "tok_s": rate, "tok_s_sd": float(np.std(rates)), "ms_per_token": 1000 / rate,
            "hit_rate": delta["hits"] / max(1, delta["hits"] + delta["misses"]),
            "gpu_read_bytes_per_token": gpu_bytes_per_token(dec, warmup + timed // 2),
            "copied_bytes_per_token": delta["bytes_copied"] / timed,
            "in_place_bytes_per_token": delta["bytes_in_place"] / timed,
            "disk_bytes_per_token": delta["bytes_read"] / timed,
            "cache_wait_ms_per_token": 1000 * delta["wait_seconds"] / timed,
            "whole_token_graph": dec.whole_token is not None, "segment_graphs": dec.segments is not None,
            "host_ms_per_token": {k: 1000 * (dec.timing[k] - timing0[k]) / timed for k in dec.timing}}
    finally:
        dec.close()
        del dec
        if device.type == "cuda":
            torch.cuda.empty_cache()


def reread(vault_dir: Path, reader, tokens: int) -> dict | None:
    """A cold row's own disk reads (the blobs its reader logged, in that order) read again from a dropped page cache,
    with as many in flight as its reader threads and nothing else to do: `limit_tok_s` is the rate the disk allows
    for exactly those reads, a limit the row cannot pass with the disk as it was just after it (a probe of other
    blobs, or minutes apart, can be passed: a virtual disk's rate moves). None when the row read nothing."""
    entries, reader.log = reader.log, None
    if not entries:
        return None
    r = read_blobs(vault_dir, entries, reader.threads, direct_io=reader.direct_fd is not None)
    return r | {"limit_tok_s": tokens / r["seconds"]}


def misses_read(dec) -> str:
    """How a decode row's misses reached the kernels: "in place" (read from pinned host RAM), "copied" (into the GPU
    cache first), or "none" (every expert resident)."""
    if dec.placement is not None:
        return "in place"
    return "none" if dec.table is not None else "copied"


def prefill_run(sm, budget_fraction: float, length: int, threads: int, repeats: int = 3, device: str = "cuda") -> dict:
    """A prompt of `length` random token ids through the GPU decoder with the cache at `budget_fraction` of the
    experts (misses from the pinned host tier, filled first), the router's own routing; one untimed run (compiles,
    cache fill), then `repeats` timed ones from position 0: their median."""
    from smoe.runtime.cuda.cache import blob_slot_bytes
    from smoe.runtime.cuda.decode import GpuDecoder

    vault, device = sm.vault, torch.device(device)
    everything = blob_slot_bytes(vault) * len(vault.entries)
    host = everything if budget_fraction < 1 else 0
    dec = GpuDecoder(sm, device, int(everything * budget_fraction), length + 8, host_cache_bytes=host, threads=threads)
    vocab = sm.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    try:
        if host:
            dec.cache.fill_host()
        rates = prompt_rates(dec, ids, repeats)
        return {"budget_fraction": budget_fraction, "length": length, "tok_s": sorted(rates)[len(rates) // 2],
                "runs_tok_s": rates}
    finally:
        dec.close()
        del dec
        if device.type == "cuda":
            torch.cuda.empty_cache()


def prompt_rates(dec, ids: list[int], repeats: int) -> list[float]:
    """tok/s of `repeats` prompts `ids` from position 0 on a GPU decoder, after one untimed one."""
    seconds = []
    for _ in range(repeats + 1):
        dec.reset()
        synchronize(dec.device)
        start = time.perf_counter()
        dec.forward(ids)
        synchronize(dec.device)
        seconds.append(time.perf_counter() - start)
    return [len(ids) / t for t in seconds[1:]]


def tensor_bytes(v) -> int:
    """Bytes of the tensors in v: a tensor, a tuple of them, or a weight bundle (a dataclass)."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, tuple):
        return sum(map(tensor_bytes, v))
    return sum(tensor_bytes(getattr(v, f.name)) for f in fields(v)) if is_dataclass(v) else 0


def gpu_bytes_per_token(dec, position: int) -> int:
    """Bytes the GPU must read for one token: trunk matrices, the k experts of each layer, the KV cache."""
    trunk = dec.lm_head.numel() * dec.lm_head.element_size()
    trunk += sum(tensor_bytes(v) for w in dec.layers for v in vars(w).values())
    experts = sum(dec.top_k * dec.cache.vault.entry(layer, 0).size for layer in dec.layouts)
    return trunk + experts + position * sum(layer.position_bytes for layer in dec.state.layers)


def transformers_run(cfg: dict, tokens: int) -> dict:
    """The same model resident in bf16 on the GPU, transformers' own generate (greedy, static shapes off)."""
    from smoe.hf.model import random_model

    torch.manual_seed(0)
    model = random_model(cfg, torch.bfloat16, "cuda")
    try:
        ids = torch.tensor([[1, 2, 3, 4]], device="cuda")
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return {"tok_s": tokens / seconds, "experts_implementation": str(getattr(model.config, "_experts_implementation", None))}
    finally:
        del model
        torch.cuda.empty_cache()


# --- llama.cpp on the same model -----------------------------------------------------------------


def gguf_of(vault_dir: Path) -> Path:
    """The vault as llama.cpp's GGUF (the experts' codes as Q4_1, the same trunk), written once beside it.
    No vocabulary: llama-bench runs token ids."""
    from smoe.export.writer import export

    path = vault_dir.parent / f"{vault_dir.name}.gguf"
    if not path.exists():
        export(vault_dir, "gguf", path, tokenizer=False, progress=True)
    return path


def cpu_moe_layers(moe_layers: list[int], fraction: float) -> int:
    """llama.cpp's --n-cpu-moe N keeps the experts of layers 0..N-1 in host RAM, computed by the CPU:
    the N that leaves about `fraction` of the MoE layers' experts on the GPU."""
    on_cpu = round((1 - fraction) * len(moe_layers))
    return moe_layers[on_cpu - 1] + 1 if on_cpu else 0


def llama_bench_run(binary: str, gguf: Path, tokens: int, n_cpu_moe: int, prompt: int = 0) -> dict:
    """llama-bench's token generation of `tokens` (no prompt), or with tokens 0 its prompt processing of `prompt`
    tokens, every layer on the GPU (-ngl 99) but the experts of --n-cpu-moe's layers, 3 repetitions."""
    cmd = [binary, "-m", str(gguf), "-ngl", "99", "-p", str(prompt), "-n", str(tokens), "-r", "3", "-o", "json",
           "--n-cpu-moe", str(n_cpu_moe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SmoeError(f"llama-bench failed ({' '.join(cmd)}): {proc.stderr.strip()[-400:]}")
    try:
        run = json.loads(proc.stdout)[0]
    except (ValueError, IndexError, KeyError):
        raise SmoeError(f"llama-bench printed no result ({' '.join(cmd)}): {proc.stdout.strip()[-200:]}") from None
    return {"tok_s": run["avg_ts"], "stdev_tok_s": run["stddev_ts"], "n_cpu_moe": n_cpu_moe,
            "n_threads": run.get("n_threads"), "flash_attn": run.get("flash_attn"), "build": run.get("build_commit"),
            "gpu": run.get("gpu_info")}


def bench_decode(workdir: str, budgets: list[float], tokens: int, warmup: int, threads: int = 16,
                 baseline: bool = True, layers: int | None = None, model: str = "qwen3-30b-a3b",
                 sources: tuple[str, ...] = ("host", "disk"), llama_bench: str | None = None,
                 prefill: tuple[int, ...] = (), routings: tuple[str, ...] = ("zipf",), device: str = "cuda",
                 config: dict | None = None, measure_bytes: int | None = None,
                 host_misses: tuple[str, ...] = ("in-place",), repeats: int = 1) -> dict:
    """Every budget's rows, each source (a full budget: host only) under each recorded routing of `routings`
    ("zipf", "uniform"), a partial budget's host rows under each way of `host_misses` ("in-place", "copy").
    `device` "cpu" runs the same rows on a CPU "device" (no GPU: tests), `config` overrides keys of the model's
    config (smaller shapes), `measure_bytes` sizes the copies that measure the link and the device memory
    (default 1 and 2 GiB), `repeats` the timed spans of `tokens` a row (see decode_run)."""
    from smoe.runtime.model import OpenedVault
    from smoe.source.description import describe_model

    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SmoeError("smoe bench decode measures the GPU runtime: no CUDA device is available")
    if not routings or not set(routings) <= set(ROUTINGS):
        raise SmoeError(f"routings {routings!r}: one or more of {', '.join(ROUTINGS)}")
    cfg = model_config(model, config, layers)
    vault_dir = write_model_vault(model_vault_dir(workdir, model, config, layers), cfg)
    d = describe_model(cfg)
    direct = direct_io_works(vault_dir)
    disk = disk_read(vault_dir, threads, direct_io=direct)
    limits = {"pinned_copy_gbps": pinned_copy_gbps(device, measure_bytes or 1 << 30),
              "hbm_gbps": hbm_gbps(device, measure_bytes or 2 << 30), "disk_gbps": disk["gbps"], "disk_read": disk}
    sm = OpenedVault(vault_dir, dtype="bfloat16" if cuda else "float32", kernel_path="dequant")  # its CPU store stays unused
    draws = {r: routing_draw(r, cfg["num_hidden_layers"], warmup + tokens * repeats + 8, seed=0, experts=d.routing.num_experts,
                             top_k=d.routing.top_k) for r in routings}
    rows = []
    try:
        for fraction in budgets:
            for source in (sources if fraction < 1 else ("host",)):
                ways = host_misses if source == "host" and fraction < 1 else ("copy",)
                for routing, way in itertools.product(routings, ways):
                    r = decode_run(sm, fraction, source, draws[routing], warmup, tokens, threads, device, routing, direct,
                                   way, repeats)
                    rows.append(with_limits(r, limits))
                    print(format_row(rows[-1]), file=sys.stderr, flush=True)
        prompts = [prefill_run(sm, f, n, threads, device=device) for f in budgets for n in prefill]
    finally:
        sm.close()
    with Vault(vault_dir) as v:
        vault_gb = sum(e.size for e in v.entries.values()) / 1e9
    result = {"benchmark": "decode", "model": model, "vault": str(vault_dir), "vault_expert_gb": vault_gb, "limits": limits,
              "layers": cfg["num_hidden_layers"], "tokens": tokens, "repeats": repeats, "warmup": warmup,
              "routings": list(routings), "rows": rows, "prefill": prompts}
    if baseline:
        result["transformers_bf16"] = transformers_run(cfg, min(tokens, 32))
    if llama_bench:
        gguf = gguf_of(vault_dir)
        result["llama_cpp"] = [llama_bench_run(llama_bench, gguf, tokens, cpu_moe_layers(list(d.moe_layers), f))
                               | {"budget_fraction": f} for f in budgets]
        result["llama_cpp_prefill"] = [llama_bench_run(llama_bench, gguf, 0, cpu_moe_layers(list(d.moe_layers), f), n)
                                       | {"budget_fraction": f, "length": n} for f in budgets for n in prefill]
    return result


def model_config(model: str, config: dict | None = None, layers: int | None = None) -> dict:
    """The config of `model` (a key of MODELS) with the keys of `config` over it, and `layers` layers if given."""
    return dict(MODELS[model]) | (config or {}) | ({"num_hidden_layers": layers} if layers else {})


def model_vault_dir(workdir, model: str, config: dict | None = None, layers: int | None = None) -> Path:
    """Where bench_decode keeps the vault of that model (built once, reused by later runs)."""
    name = f"{model}-shaped-q4-{model_config(model, config, layers)['num_hidden_layers']}L"
    if config:  # other shapes: a vault of their own
        name += f"-{zlib.crc32(json.dumps(config, sort_keys=True).encode()):08x}"
    return Path(workdir) / name


def with_limits(r: dict, limits: dict) -> dict:
    """A row with its limits: `limit_tok_s` (its I/O, plus what the GPU reads at HBM speed) and `io_limit_tok_s`
    (the I/O alone: the row's measured bytes per token moved over the pinned link, or read from the disk; None
    when nothing moved), and the share of each reached; a disk row that read something also the share of its reads'
    own rate read again (`of_reread_limit`, see reread). A disk row that was not cold (or whose disk measurement
    was not) gets no shares: `cold_note` says why."""
    disk = r["source"] == "disk"
    gbps = limits["disk_gbps"] if disk else limits["pinned_copy_gbps"]
    moved = r["disk_bytes_per_token"] if disk else r["copied_bytes_per_token"] + r.get("in_place_bytes_per_token", 0)
    io_s = moved / (gbps * 1e9)
    # HBM: a device copy's read + write bytes per second, the rate a read-only stream gets
    limit_s = io_s + r["gpu_read_bytes_per_token"] / (limits["hbm_gbps"] * 1e9)
    row = r | {"limit_tok_s": 1 / limit_s, "of_limit": r["tok_s"] * limit_s,
               "io_limit_tok_s": 1 / io_s if io_s else None, "of_io_limit": r["tok_s"] * io_s if io_s else None}
    again = r.get("reread")
    if again:  # the row's own reads read again: the disk's rate for them, just after the row
        row["of_reread_limit"] = r["tok_s"] / again["limit_tok_s"] if r["cold"] and again["cold"] else None
    if disk and not (r["cold"] and limits["disk_read"]["cold"]):
        note = r["cold_note"] or f"disk measurement {limits['disk_read']['cold_note']}"
        row |= {"of_limit": None, "of_io_limit": None, "cold_note": note}
    return row


def percent(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.0f}%"


def format_row(r: dict) -> str:
    line = (f"  budget {100 * r['budget_fraction']:5.1f}%  {r['source']:4s}  {r.get('routing', 'zipf'):7s}  "
            f"{r['tok_s']:7.1f} ± {r.get('tok_s_sd', 0):5.1f} tok/s  hit {100 * r['hit_rate']:5.1f}%  "
            f"moved {(r['copied_bytes_per_token'] + r.get('in_place_bytes_per_token', 0)) / 1e6:7.1f} MB/tok "
            f"({r.get('misses_read', 'copied')})  "
            f"limit {r['limit_tok_s']:7.1f} tok/s  ({percent(r['of_limit'])} of it)  "
            f"cache wait {r['cache_wait_ms_per_token']:.2f} ms/tok")
    io = r.get("io_limit_tok_s")
    if r["source"] == "disk" and "cold" in r:
        line += f"  read {r['disk_bytes_per_token'] / 1e6:.1f} MB/tok from disk"
        if io:
            line += f", disk limit {io:.1f} tok/s"
            line += f" ({percent(r['of_io_limit'])} of it)" if r["of_io_limit"] is not None else ""
        if r.get("reread"):
            line += (f"; its reads again, cold: {r['reread']['gbps']:.2f} GB/s, {r['reread']['limit_tok_s']:.1f} tok/s "
                     f"({percent(r.get('of_reread_limit'))} of it)")
        if r.get("cold_note"):
            line += f" [{r['cold_note']}]"
        resident = r["resident_after_drop"]
        line += (f"; {'O_DIRECT' if r['direct_io'] else 'buffered reads'}, resident pages after drop: "
                 + ("unknown" if resident is None else f"{100 * resident:.1f}%"))
    elif io:
        line += f"  link limit {io:.1f} tok/s ({percent(r['of_io_limit'])} of it)"
    return line


def format_result(result: dict) -> str:
    lim = result["limits"]
    disk = lim.get("disk_read")
    disk_text = f"disk {lim['disk_gbps']:.2f} GB/s"
    if disk:
        resident = disk["resident_after_drop"]
        disk_text += (f" ({'O_DIRECT' if disk['direct_io'] else 'buffered'} reads of one {disk['request_bytes'] / 1e6:.2f} MB "
                      f"blob each, {disk['threads']} in flight, {disk['reads']} reads; resident pages after drop: "
                      + ("unknown" if resident is None else f"{100 * resident:.1f}%")
                      + (f"; {disk['cold_note']}" if disk["cold_note"] else "") + ")")
    lines = [f"vault {result['vault']}: {result['vault_expert_gb']:.2f} GB of experts, {result['layers']} layers; "
             f"pinned copy {lim['pinned_copy_gbps']:.1f} GB/s, HBM {lim['hbm_gbps']:.0f} GB/s (read+write), {disk_text}"]
    lines += [format_row(r) for r in result["rows"]]
    for run in result.get("llama_cpp", []):
        ours = {" ".join((r.get("routing", "zipf"), r.get("misses_read", "copied"))): r["tok_s"] for r in result["rows"]
                if r["budget_fraction"] == run["budget_fraction"] and r["source"] == "host"}
        ratio = ("" if not ours else f"  (smoe host / llama.cpp = {next(iter(ours.values())) / run['tok_s']:.2f})"
                 if len(ours) == 1 else
                 "  (smoe host / llama.cpp: " + ", ".join(f"{k} {v / run['tok_s']:.2f}" for k, v in ours.items()) + ")")
        lines.append(f"  llama.cpp CUDA, --n-cpu-moe {run['n_cpu_moe']:2d} (budget {100 * run['budget_fraction']:5.1f}%): "
                     f"{run['tok_s']:7.1f} ± {run['stdev_tok_s']:.1f} tok/s" + ratio)
    for r in result.get("prefill", []):
        peer = [p for p in result.get("llama_cpp_prefill", [])
                if (p["budget_fraction"], p["length"]) == (r["budget_fraction"], r["length"])]
        lines.append(f"  prefill {r['length']:5d} tokens, budget {100 * r['budget_fraction']:5.1f}%: {r['tok_s']:8.1f} tok/s"
                     + (f"  llama.cpp {peer[0]['tok_s']:8.1f} ± {peer[0]['stdev_tok_s']:.1f} tok/s (--n-cpu-moe "
                        f"{peer[0]['n_cpu_moe']}; smoe / llama.cpp = {r['tok_s'] / peer[0]['tok_s']:.2f})" if peer else ""))
    if "transformers_bf16" in result:
        base = result["transformers_bf16"]["tok_s"]
        best = max(r["tok_s"] for r in result["rows"])
        lines.append(f"  baseline transformers bf16 resident: {base:.1f} tok/s (smoe best / baseline = {best / base:.2f})")
    return "\n".join(lines)
