"""`smoe bench`: throughput and memory figures, each printed next to a baseline run in the same process."""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from smoe.devices import resolve_device, torch_threads
from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.safetensors_io import write_safetensors

ROW = 1536  # Qwen3-235B expert width: rows of 1536 weights


def main(args) -> int:
    if args.bench == "quantize":
        result = bench_quantize(args.mb, args.device)
    elif args.bench == "sculpt":
        result = bench_sculpt(args.gb, args.workdir, args.device)
    elif args.bench in ("runtime", "runtime-synthetic"):
        return bench_runtime_main(args)
    elif args.bench == "kernels":
        return bench_kernels_main(args)
    elif args.bench == "decode":
        return bench_decode_main(args)
    else:
        raise SmoeError(f"unknown benchmark {args.bench!r}")
    result["machine"] = machine_description(result.get("device", "cpu"))
    print(json.dumps(result, indent=1) if args.json else format_result(result))
    return 0


def bench_runtime_main(args) -> int:
    from smoe.bench import runtime as bench_runtime

    budgets = parse_budgets(args.budgets)
    if args.bench == "runtime":
        result = bench_runtime.bench_model(args.vault, args.ref, args.gguf, budgets, args.tokens, args.dtype,
                                           torch_threads(args.threads, "--threads"), args.decoder,
                                           args.memory_limit_gb)
    else:
        result = bench_runtime.bench_synthetic(args.workdir, args.layers, args.tokens, budgets)
    result["machine"] = machine_description("cpu")
    print(json.dumps(result, indent=1) if args.json else f"machine: {result['machine']}\n" + bench_runtime.format_result(result))
    return 0


def parse_budgets(text: str) -> list[float]:
    """--budgets "0.05,0.25,1": cache budgets as fractions of all experts, each in (0, 1]."""
    try:
        budgets = [float(b) for b in text.split(",")]
    except ValueError:
        raise SmoeError(f"--budgets {text!r}: expected fractions separated by commas, e.g. 0.05,0.25,1") from None
    if not all(0 < b <= 1 for b in budgets):
        raise SmoeError(f"--budgets {text!r}: each budget is a fraction of all experts, in (0, 1]")
    return budgets


def parse_lengths(text: str) -> tuple[int, ...]:
    """--prefill's prompt lengths ("" for none)."""
    try:
        lengths = tuple(int(n) for n in text.split(",")) if text else ()
    except ValueError:
        raise SmoeError(f"--prefill {text!r}: expected token counts separated by commas, e.g. 512,2048") from None
    if not all(n > 0 for n in lengths):
        raise SmoeError(f"--prefill {text!r}: each prompt length is a positive number of tokens")
    return lengths


def bench_decode_main(args) -> int:
    """The GPU runtime on a Qwen3-30B-A3B- or DeepSeek-V2-Lite-shaped vault (smoe/bench/decode.py)."""
    from smoe.bench import decode as bench_decode

    budgets = parse_budgets(args.budgets)
    prefill = parse_lengths(args.prefill)
    sources = tuple(args.sources.split(","))
    if not sources or not set(sources) <= {"host", "disk"}:
        raise SmoeError(f"--sources {args.sources!r}: host, disk or both, separated by a comma")
    routing = getattr(args, "routing", "zipf")
    routings = tuple(routing.split(","))
    if not set(routings) <= {"zipf", "uniform"} or len(set(routings)) != len(routings):
        raise SmoeError(f"--routing {routing!r}: zipf, uniform or both, separated by a comma")
    host_misses = tuple(args.host_misses.split(","))
    if not host_misses or not set(host_misses) <= {"in-place", "copy"} or len(set(host_misses)) != len(host_misses):
        raise SmoeError(f"--host-misses {args.host_misses!r}: in-place, copy or both, separated by a comma")
    if args.llama_bench and not (os.path.isfile(args.llama_bench) and os.access(args.llama_bench, os.X_OK)):
        raise SmoeError(f"--llama-bench {args.llama_bench}: not an executable file (llama.cpp's llama-bench)")
    result = bench_decode.bench_decode(args.workdir, budgets, args.tokens, args.warmup, args.threads,
                                       baseline=not args.no_baseline, layers=args.layers, model=args.model,
                                       sources=sources, llama_bench=args.llama_bench,
                                       prefill=prefill, routings=routings, host_misses=host_misses,
                                       repeats=args.repeats)
    result["machine"] = machine_description("cuda")
    print(json.dumps(result, indent=1) if args.json else f"machine: {result['machine']}\n" + bench_decode.format_result(result))
    return 0


def bench_kernels_main(args) -> int:
    """The Triton expert kernels against cuBLAS bf16 and torch int4 (smoe/bench/kernels_gpu.py)."""
    if resolve_device(args.device).type != "cuda":
        raise SmoeError("smoe bench kernels measures the CUDA kernels: no CUDA device is available")
    from smoe.bench import kernels_gpu as bench_kernels_gpu

    result = bench_kernels_gpu.bench_kernels(args.shape, args.pool_gb)
    print(json.dumps(result, indent=1) if args.json else bench_kernels_gpu.format_result(result))
    return 0


def machine_description(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"


def synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev: torch.device, repeats: int = 3) -> float:
    """Median wall time of `repeats` runs after one warm-up run."""
    fn()
    synchronize(dev)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        synchronize(dev)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def bench_quantize(mb: float, device: str) -> dict:
    """MB/s of bf16 input through the full 64-candidate search, against the plain-torch reference search."""
    dev = resolve_device(device)
    rows = max(1, int(mb * 1e6 / 2 / ROW))
    w = torch.randn(rows, ROW, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(dev)
    small = w[: max(1, rows // 64)]  # the reference is slow: time it on a slice
    result = {"benchmark": "quantize", "device": str(dev), "input_mb": w.numel() * 2 / 1e6, "depths": []}
    for bits in (4, 2):
        fast = timed(lambda: codec.encode(w, bits), dev)
        ref = timed(lambda: codec.encode(small, bits, backend="reference"), dev, repeats=1)
        fast_mbs = w.numel() * 2 / fast / 1e6
        ref_mbs = small.numel() * 2 / ref / 1e6
        result["depths"].append({"bits": bits, "backend": "triton" if dev.type == "cuda" else "numba",
                                 "mb_per_s": fast_mbs, "reference_mb_per_s": ref_mbs, "speedup": fast_mbs / ref_mbs})
    return result


# --- peak RSS of the sculptor on a synthetic checkpoint ------------------------------------------

SYNTH_HIDDEN, SYNTH_INTER, SYNTH_EXPERTS = 2048, 768, 16  # Qwen3-30B-A3B expert shapes


def synthetic_config(layers: int, experts: int = SYNTH_EXPERTS, top_k: int = 4) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": SYNTH_HIDDEN,
        "intermediate_size": 6144, "moe_intermediate_size": SYNTH_INTER, "num_hidden_layers": layers,
        "num_experts": experts, "num_experts_per_tok": top_k, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 8192, "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False, "norm_topk_prob": True,
    }


def synthetic_tensors(layers: int, experts: int = SYNTH_EXPERTS) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (8192, SYNTH_HIDDEN), "lm_head.weight": (8192, SYNTH_HIDDEN),
              "model.norm.weight": (SYNTH_HIDDEN,)}
    for layer in range(layers):
        p = f"model.layers.{layer}"
        shapes[f"{p}.input_layernorm.weight"] = (SYNTH_HIDDEN,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (SYNTH_HIDDEN,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (2048, SYNTH_HIDDEN)
        shapes[f"{p}.self_attn.k_proj.weight"] = (512, SYNTH_HIDDEN)
        shapes[f"{p}.self_attn.v_proj.weight"] = (512, SYNTH_HIDDEN)
        shapes[f"{p}.self_attn.o_proj.weight"] = (SYNTH_HIDDEN, 2048)
        shapes[f"{p}.self_attn.q_norm.weight"] = (128,)
        shapes[f"{p}.self_attn.k_norm.weight"] = (128,)
        shapes[f"{p}.mlp.gate.weight"] = (experts, SYNTH_HIDDEN)
        for e in range(experts):
            for role, shape in (("gate", (SYNTH_INTER, SYNTH_HIDDEN)), ("up", (SYNTH_INTER, SYNTH_HIDDEN)),
                                ("down", (SYNTH_HIDDEN, SYNTH_INTER))):
                shapes[f"{p}.mlp.experts.{e}.{role}_proj.weight"] = shape
    return shapes


def write_synthetic_checkpoint(directory: Path, gb: float | None = None, layers: int | None = None,
                               experts: int = SYNTH_EXPERTS, top_k: int = 4) -> int:
    """Shards of random bf16 weights, one layer per shard, written tensor by tensor; returns bytes. The depth is
    `layers`, or what makes about `gb` of experts."""
    expert_bytes_per_layer = experts * 3 * SYNTH_HIDDEN * SYNTH_INTER * 2
    layers = layers or max(1, round(gb * 1e9 / expert_bytes_per_layer))
    directory.mkdir(parents=True, exist_ok=True)
    need, free = layers * expert_bytes_per_layer, shutil.disk_usage(directory).free
    if need > free:  # checked before its tables of tensors, which grow with the depth
        raise SmoeError(f"{directory}: the synthetic checkpoint needs {need / 1e9:.3g} GB, and {free / 1e9:.3g} GB is "
                        f"free there (a smaller --gb, or --workdir on a larger disk)")
    (directory / "config.json").write_text(json.dumps(synthetic_config(layers, experts, top_k)))
    shapes = synthetic_tensors(layers, experts)
    shard_of = {n: (int(n.split(".")[2]) if n.startswith("model.layers.") else layers) for n in shapes}
    weight_map, total = {}, 0
    gen = torch.Generator().manual_seed(0)
    for shard in range(layers + 1):
        names = [n for n in shapes if shard_of[n] == shard]
        fname = f"model-{shard:05d}-of-{layers + 1:05d}.safetensors"
        specs = [(n, torch.bfloat16, shapes[n]) for n in names]
        write_safetensors(directory / fname, specs, lambda n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16))
        weight_map.update({n: fname for n in names})
        total += (directory / fname).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def peak_rss_of(cmd: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of a child process."""
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SmoeError(f"benchmark command failed: {' '.join(cmd)}: {proc.stderr.strip()[-500:]}")
    return seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def bench_sculpt(gb: float, workdir: str | None, device: str = "cpu") -> dict:
    """Peak RSS of `smoe quantize` on a synthetic checkpoint, against a process that only imports smoe."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        src, out = Path(tmp) / "model", Path(tmp) / "vault"
        size = write_synthetic_checkpoint(src, gb)
        # the baseline runs first: RUSAGE_CHILDREN reports the largest child so far
        backend = "search_triton" if device == "cuda" else "search_numba"
        _, base_rss = peak_rss_of([sys.executable, "-c", f"import smoe.convert.sculpt, smoe.format.{backend}"])
        seconds, rss = peak_rss_of([sys.executable, "-m", "smoe.cli", "quantize", str(src), "-o", str(out), "-q",
                                    "--device", device])
        largest = 8192 * SYNTH_HIDDEN * 2
        return {"benchmark": "sculpt", "device": device, "checkpoint_gb": size / 1e9, "seconds": seconds,
                "mb_per_s": size / seconds / 1e6, "peak_rss_gb": rss / 1e9, "import_only_rss_gb": base_rss / 1e9,
                "largest_tensor_gb": largest / 1e9, "rss_over_checkpoint": rss / size}


def format_result(r: dict) -> str:
    lines = [f"machine: {r['machine']}"]
    if r["benchmark"] == "quantize":
        lines.append(f"input: {r['input_mb']:.1f} MB of bf16 weights on {r['device']}")
        for d in r["depths"]:
            lines.append(f"SMOE-Q{d['bits']} {d['backend']:>6}: {d['mb_per_s']:8.1f} MB/s   reference search "
                         f"{d['reference_mb_per_s']:6.2f} MB/s   ratio {d['speedup']:.0f}x")
    else:
        lines.append(f"checkpoint {r['checkpoint_gb']:.2f} GB sculpted in {r['seconds']:.1f} s ({r['mb_per_s']:.0f} MB/s)")
        lines.append(f"peak RSS {r['peak_rss_gb']:.2f} GB (import only: {r['import_only_rss_gb']:.2f} GB; "
                     f"largest tensor {r['largest_tensor_gb']:.3f} GB) = {r['rss_over_checkpoint']:.2f} x checkpoint size")
    return "\n".join(lines)
