"""The `smoe` command: one subcommand per user action, each a thin call into the modules."""

from __future__ import annotations

import argparse
import json
import os
import sys

from smoe import numeric
from smoe.errors import SmoeError
from smoe.format.paths import check_outputs
from smoe.hf.bars import quiet_library_bars
from smoe.hf.tokenizer import check_text, load_tokenizer
from smoe.source.hub import resolve_model
from smoe.version import __version__


def cmd_quantize(args) -> int:
    from smoe.cli import quantize as planning
    from smoe.convert.sculpt import sculpt

    args.model = resolve_model(args.model)
    check_outputs([args.output], [args.model, args.calib, args.plan])
    progress = not args.quiet and not args.json
    depths, encoder, stats, planned = planning.quantize_inputs(args, progress)
    report = sculpt(args.model, args.output, bits=args.bits, device=args.device, force=args.force,
                    num_experts=args.num_experts, progress=progress, alignment=args.alignment,
                    encoder=encoder, calib=args.calib, plan=depths, calib_tokens=args.calib_tokens, stats=stats,
                    reads=[args.plan])
    measured = planning.after_quantize(args, planned)
    if args.json:
        print(json.dumps(vars(report) | {"expert_share": report.expert_share, "depth": report.depth} | measured, indent=1))
    else:
        print_sculpt_summary(report, args.output)
        planning.print_measured(measured)
    return 0


def cmd_plan(args) -> int:
    from smoe.cli.quantize import cmd_plan as run

    args.model = resolve_model(args.model)
    return run(args)


def print_sculpt_summary(r, out) -> None:
    print(f"vault     {out}  ({r.family}, {r.depth})")
    print(f"experts   {r.experts}" + (f"  ({r.resumed_experts} resumed from a partial run)" if r.resumed_experts else ""))
    print(f"bytes in  experts {r.expert_bytes_in / 1e6:,.1f} MB + trunk {r.trunk_bytes / 1e6:,.1f} MB"
          f"  (experts are {100 * r.expert_share:.1f}% of the checkpoint)")
    print(f"bytes out experts {r.expert_bytes_out / 1e6:,.1f} MB, vault {r.vault_bytes / 1e6:,.1f} MB")
    for role, snr in r.snr_db.items():
        print(f"SNR       {role:<5} {snr:6.2f} dB (mean over experts)")
    print(f"time      {r.seconds:.1f} s")


def cmd_verify(args) -> int:
    from smoe.format.vault import verify, version_notice
    from smoe.progress import bar as progress_bar

    bar = None if args.json else (lambda xs: progress_bar(xs, unit="blob", desc="verify"))
    problems = verify(args.vault, progress=bar)
    problems = problems or config_problems(args.vault)
    notes = [] if problems or not (notice := version_notice(args.vault)) else [notice]
    if args.json:
        print(json.dumps({"vault": args.vault, "ok": not problems, "problems": problems, "notes": notes}, indent=1))
    else:
        for p in problems:
            print(f"FAIL {p}")
        for note in notes:
            print(f"NOTE {note}")
        print("vault OK" if not problems else f"{len(problems)} problem(s) found")
    return 0 if not problems else 1


def config_problems(vault_dir) -> list[str]:
    """What opening would refuse in a sound vault: its config's values, and the index against them."""
    from smoe.format.vault import Vault
    from smoe.source.families import check_vault_config

    try:
        with Vault(vault_dir) as vault:
            check_vault_config(vault.config, vault.meta, vault.dir)
    except SmoeError as e:
        return [str(e)]
    return []


def cmd_inspect(args) -> int:
    from smoe.source.inspect import format_report, inspect_path

    report = inspect_path(resolve_model(args.path), disk_gbps=args.disk_gbps, num_experts=args.num_experts)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def cmd_test_quant(args) -> int:
    from smoe.quality import codec_report as quant_report

    rows, failures = quant_report.run()
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print(quant_report.format_row(row))
        for f in failures:
            print(f"FAIL {f}")
        print("PASS: SMOE-Q2 and SMOE-Q4 meet their SNR floors and beat absmax scaling" if not failures else "FAIL")
    return 0 if not failures else 1


def open_model(args):
    import torch

    from smoe.devices import torch_threads
    from smoe.runtime.model import OpenedVault

    torch.set_num_threads(torch_threads(args.torch_threads))
    cache = None if args.cache_gb is None else int(args.cache_gb * 1e9)
    gpu_cache = None if args.gpu_cache_gb is None else int(args.gpu_cache_gb * 1e9)
    return OpenedVault(args.vault, dtype=args.dtype, cache_bytes=cache, threads=args.threads,
                          direct_io=args.direct_io, device=args.device, gpu_cache_bytes=gpu_cache,
                          decoder=args.decoder)


def cmd_generate(args) -> int:
    from smoe.runtime.generate import TextStreamer, generate

    sm = open_model(args)
    tok = load_tokenizer(args.vault)
    prompt = tok(check_text(args.prompt, "the prompt"), add_special_tokens=True)["input_ids"]
    streamer = None if args.json else TextStreamer(tok, sys.stdout)
    tokens, stats = generate(sm, prompt, args.max_tokens, on_token=streamer,
                             params=sampling_params(args))
    if args.json:
        print(json.dumps({"text": tok.decode(tokens, skip_special_tokens=True), "tokens": tokens,
                          "stats": stats.as_dict(), **sm.describe()}))
    else:
        print("\n" + stats.line(), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from smoe.cli import chat

    return chat.run(open_model(args), load_tokenizer(args.vault), args, sampling_params(args))


def cmd_eval(args) -> int:
    from smoe.quality.evaluate import compare, load_reference
    from smoe.source.text import token_stream

    ref = resolve_model(args.ref)  # before the vault is opened: a missing model is a quick error
    sm = open_model(args)
    tok = load_tokenizer(args.vault)
    ids = token_stream(tok, args.data, args.tokens)
    result = compare(sm.logits, load_reference(ref), ids, progress=not args.json) | sm.describe()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"tokens {result['tokens']}  ppl {result['ppl']:.3f}  ref ppl {result['ref_ppl']:.3f}  "
              f"KL {result['kl']:.5f}  top-1 {result['top1']:.4f}")
    return 0


def cmd_dequantize(args) -> int:
    from smoe.convert.dequantize import dequantize
    from smoe.format.dtypes import TORCH_NAMES

    out = dequantize(args.vault, args.output, dtype=TORCH_NAMES[args.dtype], force=args.force)
    print(f"wrote {out}")
    return 0


def cmd_export(args) -> int:
    from smoe.export.writer import export

    options = {"progress": not args.quiet}
    if args.trunk_type is not None:
        if args.to != "gguf":
            raise SmoeError("--trunk-type applies to --to gguf only (MLX keeps the trunk's precision)")
        options["trunk_type"] = args.trunk_type
    out = export(args.vault, args.to, args.output, force=args.force, **options)
    print(f"wrote {out}")
    return 0


def cmd_serve(args) -> int:
    from smoe.serve.server import Limits, run_server

    limits = Limits(max_body_bytes=int(args.max_body_mb * 2**20), max_tokens=args.max_tokens, max_queue=args.max_queue,
                    idle_timeout=args.idle_timeout, request_timeout=args.request_timeout,
                    max_connections=args.max_connections, log_level=args.log_level)
    return run_server(lambda: open_model(args), load_tokenizer, args.vault, args.host, args.port, limits)


def default_torch_threads() -> int:
    import os

    cores = os.cpu_count() or 1
    return 1 if cores <= 2 else cores


def add_quality_options(p: argparse.ArgumentParser) -> None:
    from smoe.convert.encoders import CALIB_TOKENS, DEFAULT, ENCODERS

    p.add_argument("--encoder", choices=ENCODERS, default=None,
                   help=f"how codes and scales are chosen (default: {DEFAULT} with --calib, grid without)")
    p.add_argument("--calib", metavar="TEXT_FILE", help="calibration text (.gz allowed); never the evaluation text")
    p.add_argument("--calib-tokens", type=numeric.COUNT.parse, default=None, help=f"calibration tokens (default {CALIB_TOKENS})")


def add_runtime_options(p: argparse.ArgumentParser, dtype: str = "bfloat16") -> None:
    p.add_argument("vault", metavar="VAULT_DIR")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="cuda: trunk and expert cache on the GPU; auto (default): cuda when there is a GPU and its "
                   "fast decoder runs every layer of this vault on its kernels, else cpu (BENCHMARKS.md)")
    p.add_argument("--decoder", default="auto", choices=("auto", "fast", "generic"),
                   help="fast: the compiled decode step (the models it covers, e.g. Qwen3-MoE, Mixtral); generic: the model's own transformers "
                   "modules (every family); auto (default): fast where the family has it")
    p.add_argument("--cache-gb", type=numeric.NON_NEGATIVE_REAL.parse, default=None,
                   help="expert cache budget in host RAM, GB (CPU default: half of the available RAM, at most all "
                   "experts; on a GPU it is a pinned host tier between disk and GPU, default none)")
    p.add_argument("--gpu-cache-gb", type=numeric.NON_NEGATIVE_REAL.parse, default=None,
                   help="GPU expert cache budget, GB (default: all experts if they fit in 80%% of the free GPU "
                   "memory, else that)")
    p.add_argument("--dtype", default=dtype, choices=("float32", "bfloat16"), help=f"compute dtype (default {dtype})")
    p.add_argument("--threads", type=numeric.THREADS.parse, default=16, help="parallel expert reads (default 16, for NVMe)")
    p.add_argument("--direct-io", action="store_true", help="read experts with O_DIRECT, bypassing the page cache")
    p.add_argument("--torch-threads", type=numeric.THREADS.parse, default=default_torch_threads(),
                   help="threads for torch's CPU ops (default: 1 on machines of 2 cores or fewer, where batch-1 "
                   "ops are too small to split and a second thread mostly waits; else all cores)")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=numeric.MAX_TOKENS.parse, default=128)
    p.add_argument("--temperature", type=numeric.TEMPERATURE.parse, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=numeric.TOP_P.parse, default=1.0)
    p.add_argument("--top-k", type=numeric.TOP_K.parse, default=0, help="0 = off (default)")
    p.add_argument("--min-p", type=numeric.MIN_P.parse, default=0.0, help="keep tokens of at least this times the top "
                   "token's probability; 0 = off (default)")
    p.add_argument("--repeat-penalty", type=numeric.REPETITION_PENALTY.parse, default=1.0,
                   help="divide seen tokens' positive logits by it, multiply negative ones; 1 = off (default)")
    p.add_argument("--frequency-penalty", type=numeric.PENALTY.parse, default=0.0,
                   help="subtract it times each token's count in the output so far (-2..2, default 0)")
    p.add_argument("--presence-penalty", type=numeric.PENALTY.parse, default=0.0,
                   help="subtract it from every token already in the output (-2..2, default 0)")
    p.add_argument("--seed", type=numeric.SEED.parse, default=0)


def sampling_params(args):
    from smoe.runtime.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repeat_penalty, frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty, seed=args.seed)


def cmd_bench(args) -> int:
    from smoe.bench import main as bench

    return bench.main(args)


def cmd_demo(args) -> int:
    from smoe.cli import demo

    return demo.main(args)


HUB_HELP = "a HF model directory, or a hub id (ORG/NAME) already in the local Hugging Face cache"


class Parser(argparse.ArgumentParser):
    """argparse's errors in smoe's form: `smoe: error: …` on one line and exit 2; a mistyped option
    also gets the usage of the subcommand it was given to, which lists the right ones."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments"):
            self.print_usage(sys.stderr)
        self.exit(2, f"smoe: error: {message}\n")


def subcommand_parsers(parser: argparse.ArgumentParser):
    """Every (sub)subcommand's parser, each told its own name so main can hand it its errors."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for sub in action.choices.values():
            sub.set_defaults(parser=sub)
            yield from subcommand_parsers(sub)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="smoe", description="Seal the routed experts of a Hugging Face MoE checkpoint "
                                "into SMOE-Q4/Q2 vaults and inspect what a model costs to stream.")
    p.add_argument("--version", action="version", version=f"smoe {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    q = sub.add_parser("quantize", help="sculpt a HF MoE checkpoint into a vault",
                       description="Quantise the routed experts of MODEL (a HF model directory with safetensors) "
                       "into a vault; everything else is kept at source precision.")
    q.add_argument("model", metavar="MODEL_DIR", help=HUB_HELP)
    q.add_argument("-o", "--output", required=True, metavar="VAULT_DIR")
    q.add_argument("--bits", type=int, choices=(4, 2), default=4, help="SMOE-Q4 (default) or SMOE-Q2")
    q.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run the scale search")
    q.add_argument("--force", action="store_true", help="replace an existing output and discard a partial run")
    q.add_argument("--num-experts", type=numeric.COUNT.parse, help="experts per MoE layer, for checkpoints whose config lacks it")
    q.add_argument("--alignment", type=int, choices=(4096, 16384), default=4096,
                   help="blob alignment in bytes (16384 for 16 KiB-page systems)")
    q.add_argument("--json", action="store_true", help="print the summary as JSON")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    add_quality_options(q)
    q.add_argument("--plan", metavar="PLAN_JSON", help="depth per tensor from `smoe plan` (overrides --bits)")
    q.add_argument("--budget", type=numeric.BITS_PER_WEIGHT.parse, metavar="BITS", help="plan and write a mixed vault of at most BITS bits/weight "
                   "(scales included; needs --calib); plan, sensitivity table and heatmap go beside the vault")
    q.set_defaults(func=cmd_quantize)

    pl = sub.add_parser("plan", help="choose a depth per fused expert tensor: least KL within a size budget",
                        description="Measure KL(source || model with one fused expert tensor quantised) for each tensor "
                        "and depth on the calibration text (resumable sensitivity table), then solve the allocation "
                        "exactly. Writes PLAN_JSON and a PNG heatmap beside it.")
    pl.add_argument("model", metavar="MODEL_DIR", help=HUB_HELP)
    budget = pl.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget", type=numeric.BITS_PER_WEIGHT.parse, metavar="BITS", help="bits per expert weight, scales included (2.25-4.25)")
    budget.add_argument("--size", type=numeric.POSITIVE_REAL.parse, metavar="GB", help="size of experts.bin in GB (1e9 bytes), alignment included")
    pl.add_argument("-o", "--output", default="plan.json", metavar="PLAN_JSON", help="default plan.json")
    pl.add_argument("--sensitivity", metavar="JSON", help="the sensitivity table (default: PLAN.sensitivity.json)")
    add_quality_options(pl)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    pl.set_defaults(func=cmd_plan)

    v = sub.add_parser("verify", help="check every checksum and the index of a vault (exit 0 only if sound)")
    v.add_argument("vault", metavar="VAULT_DIR")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=cmd_verify)

    i = sub.add_parser("inspect", help="what a model or vault costs to stream",
                       description="PATH: a model directory, a directory with config.json + index, a bare "
                       "config.json, a vault, or a hub id (ORG/NAME) already in the local Hugging Face cache.")
    i.add_argument("path", metavar="PATH")
    i.add_argument("--json", action="store_true")
    i.add_argument("--disk-gbps", type=numeric.BANDWIDTH_GBPS.parse, default=7.4, help="disk read bandwidth in GB/s (default 7.4)")
    i.add_argument("--num-experts", type=numeric.COUNT.parse, help="experts per MoE layer, for configs that lack it")
    i.set_defaults(func=cmd_inspect)

    t = sub.add_parser("test-quant", help="codec self-test: SNR of both depths on a fixed Gaussian tensor",
                       description="Quantise a fixed-seed 128x64 Gaussian tensor at SMOE-Q2 and SMOE-Q4. RMSE and "
                       "absmax are the root-mean-square and the largest absolute reconstruction error.")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=cmd_test_quant)

    g = sub.add_parser("generate", help="generate text from a vault, experts streamed from disk")
    add_runtime_options(g)
    g.add_argument("-p", "--prompt", required=True)
    add_sampling_options(g)
    g.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with a vault")
    add_runtime_options(c)
    add_sampling_options(c)
    c.add_argument("--system", metavar="TEXT", help="the system prompt (in the chat: /system TEXT)")
    c.add_argument("--ctx", type=numeric.COUNT.parse, metavar="N",
                   help="tokens the conversation may fill, at most the model's context (default: all of it); "
                   "when full, the oldest exchanges are forgotten")
    c.set_defaults(func=cmd_chat)

    e = sub.add_parser("eval", help="perplexity, KL and top-1 agreement of a vault against its source model",
                       description="The first N tokens of FILE as one stream, no BOS, windows of 512, fp32 logits.")
    add_runtime_options(e, dtype="float32")
    e.add_argument("--ref", required=True, metavar="MODEL_DIR", help="the bf16 source model (" + HUB_HELP + ")")
    e.add_argument("--data", required=True, metavar="FILE", help="text file (.gz allowed)")
    e.add_argument("--tokens", type=numeric.EVAL_TOKENS.parse, default=16384)
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    dq = sub.add_parser("dequantize", help="write a HF checkpoint whose experts are the vault's decoded values")
    dq.add_argument("vault", metavar="VAULT_DIR")
    dq.add_argument("-o", "--output", required=True, metavar="DIR")
    dq.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    dq.add_argument("--force", action="store_true")
    dq.set_defaults(func=cmd_dequantize)

    ex = sub.add_parser("export", help="write a vault as GGUF (llama.cpp) or as an mlx-lm model",
                        description="GGUF: one file, experts as Q4_1 (exact up to the fp16 rounding of each "
                        "scale), trunk at the vault's precision or as --trunk-type. MLX: a directory of safetensors shards, experts in "
                        "MLX affine form, trunk at the vault's precision.")
    ex.add_argument("vault", metavar="VAULT_DIR")
    ex.add_argument("--to", required=True, choices=("gguf", "mlx"))
    ex.add_argument("-o", "--output", required=True, metavar="FILE_OR_DIR")
    ex.add_argument("--trunk-type", choices=("bf16", "f16", "f32", "q8_0"), default=None,
                    help="GGUF type of the trunk's matrices (default: the vault's own dtype, exact)")
    ex.add_argument("--force", action="store_true", help="replace an existing output")
    ex.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ex.set_defaults(func=cmd_export)

    sv = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server with a web chat page",
                        description="Serve a vault over HTTP: the web chat at /, the OpenAI API at /v1 "
                        "(chat/completions, completions, models), the Anthropic API at /v1/messages, "
                        "/health and /metrics. Requests run one at a time, in arrival order.")
    add_runtime_options(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    sv.add_argument("--port", type=numeric.PORT.parse, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    sv.add_argument("--max-tokens", type=numeric.MAX_TOKENS.parse, default=4096, help="most new tokens one request may ask for (default 4096)")
    sv.add_argument("--max-body-mb", type=numeric.BODY_MB.parse, default=1.0, help="largest request body in MiB (default 1)")
    sv.add_argument("--max-queue", type=numeric.COUNT.parse, default=64, help="requests waiting or running at once (default 64)")
    sv.add_argument("--idle-timeout", type=numeric.POSITIVE_REAL.parse, default=5.0, help="seconds a connection may stay silent with no request in flight (default 5)")
    sv.add_argument("--request-timeout", type=numeric.POSITIVE_REAL.parse, default=30.0, help="seconds for a request's head to arrive once begun, and again for its body (default 30)")
    sv.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                    help="info (default): one access-log line per request on stderr; warning: problems only")
    sv.add_argument("--max-connections", type=numeric.COUNT.parse, default=1024, help="open connections at most; at the limit the oldest idle one makes room (default 1024)")
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks (ratios against a baseline in the same process)")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    bq = bsub.add_parser("quantize", help="scale-search throughput in MB/s of bf16 input")
    bq.add_argument("--mb", type=numeric.POSITIVE_REAL.parse, default=96.0, help="MB of bf16 weights to encode per depth")
    bq.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    bq.add_argument("--json", action="store_true")
    bs = bsub.add_parser("sculpt", help="peak RSS and throughput of `smoe quantize` on a synthetic checkpoint")
    bs.add_argument("--gb", type=numeric.POSITIVE_REAL.parse, default=4.0, help="size of the synthetic checkpoint in GB")
    bs.add_argument("--workdir", default=None, help="where to build it (default: a temporary directory)")
    bs.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the sculptor runs its search")
    bs.add_argument("--json", action="store_true")
    bk = bsub.add_parser("kernels", help="Triton expert kernels vs cuBLAS bf16 and torch int4 (effective GB/s, CUDA only)")
    bk.add_argument("--device", default="auto", choices=("auto", "cuda"))
    bk.add_argument("--shape", action="append", choices=("qwen3-235b-a22b", "qwen3-30b-a3b"),
                    help="expert shapes to measure (default: both)")
    bk.add_argument("--pool-gb", type=numeric.POSITIVE_REAL.parse, default=1.2, help="GB of distinct experts each variant rotates over")
    bk.add_argument("--json", action="store_true")
    br = bsub.add_parser("runtime", help="decode tok/s, hit rate, bytes read and peak RSS per cache budget (cold)")
    br.add_argument("vault", metavar="VAULT_DIR")
    br.add_argument("--ref", metavar="MODEL_DIR", help="also time transformers running this model resident in bf16")
    br.add_argument("--gguf", metavar="FILE", help="also time llama.cpp (llama-cpp-python) on this GGUF")
    br.add_argument("--budgets", default="0.05,0.25,1.0", help="cache budgets as fractions of all experts")
    br.add_argument("--tokens", type=numeric.COUNT.parse, default=128)
    br.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    br.add_argument("--threads", type=numeric.THREADS.parse, default=1)
    br.add_argument("--decoder", default="auto", choices=("auto", "fast", "generic"))
    br.add_argument("--memory-limit-gb", type=numeric.POSITIVE_REAL.parse, help="run smoe and llama.cpp inside a memory cgroup of this size")
    br.add_argument("--json", action="store_true")
    bsy = bsub.add_parser("runtime-synthetic", help="the expert store on a synthetic several-GB vault, skewed routing")
    bsy.add_argument("--workdir", default="out/bench", help="where the synthetic vault is built (kept for reruns)")
    bsy.add_argument("--layers", type=numeric.COUNT.parse, default=12, help="layers of 128 Qwen3-30B-A3B experts (12: 3.9 GB at Q4)")
    bsy.add_argument("--tokens", type=numeric.COUNT.parse, default=32)
    bsy.add_argument("--budgets", default="0.05,0.25,1.0")
    bsy.add_argument("--json", action="store_true")
    bd = bsub.add_parser("decode", help="GPU decode tok/s of a Qwen3-30B-A3B-shaped vault per GPU cache budget, "
                         "experts in host RAM or on disk, against transformers bf16 (CUDA only)")
    bd.add_argument("--workdir", default="out/bench-gpu", help="where the ~16 GB vault is built (kept for reruns)")
    bd.add_argument("--budgets", default="1.0,0.5,0.25,0.1", help="GPU cache budgets as fractions of all experts")
    bd.add_argument("--tokens", type=numeric.COUNT.parse, default=64, help="timed tokens per row")
    bd.add_argument("--warmup", type=numeric.NON_NEGATIVE.parse, default=32, help="tokens decoded first, to bring the cache to steady state")
    bd.add_argument("--layers", type=numeric.COUNT.parse, default=None, help="fewer layers than the real 48 (quick checks)")
    bd.add_argument("--threads", type=numeric.THREADS.parse, default=16, help="parallel expert reads")
    bd.add_argument("--no-baseline", action="store_true", help="skip transformers bf16 resident on the GPU")
    bd.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("demo", help="the main job end to end on a built-in default model")
    d.add_argument("--workdir", default="out/demo", help="where the vaults go (default out/demo)")
    d.set_defaults(func=cmd_demo)
    for _ in subcommand_parsers(p):
        pass
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand that was given them, not by the top level
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    quiet_library_bars()
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return status
    except SmoeError as e:
        print(f"smoe: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `smoe verify --json | head -1`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a full disk, a read-only directory, a file over the size limit
        where = f": {e.filename}" if e.filename else ""
        what = e.strerror or f"a write stopped short ({e}): is the disk full?"  # buffered writes lose the errno
        print(f"smoe: error: {what}{where}{resumable(args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"smoe: interrupted{resumable(args)}", file=sys.stderr)
        return 130


def resumable(args) -> str:
    """What an interrupted or failed write leaves: only quantize keeps a partial vault to resume, and
    only once it holds a blob."""
    from smoe.format.output import kept_partial

    if args.command != "quantize" or kept_partial(args.output) is None:
        return ""
    return " (the partial vault is kept; the same command resumes it)"


if __name__ == "__main__":
    sys.exit(main())
