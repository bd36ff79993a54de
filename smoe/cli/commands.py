"""The `smoe` command: one subcommand per user action, each a thin call into the modules."""

from __future__ import annotations

import argparse
import json
import os
import sys

from smoe import numeric
from smoe.cli.interrupts import guarded
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
    encode_all = planning.cluster_encoder(args)  # --ray's cluster checked before any work
    depths, encoder, stats, planned = planning.quantize_inputs(args, progress)
    report = sculpt(args.model, args.output, bits=args.bits, device=args.device, force=args.force,
                    num_experts=args.num_experts, progress=progress, alignment=args.alignment,
                    encoder=encoder, calib=args.calib, plan=depths, calib_tokens=args.calib_tokens, stats=stats,
                    reads=[args.plan], encode_all=encode_all)
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
        weighted = r.weighted_snr_db.get(role)
        output = f", output {weighted:6.2f} dB" if weighted is not None else ""
        print(f"SNR       {role:<5} weights {snr:6.2f} dB{output} (means over experts)")
    if r.weighted_snr_db:
        print("          output: the error weighted by the inputs' second moments, which the calibrated encoder "
              "minimises (its weight SNR may be below the grid search's)")
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
    from smoe.source.config_checks import check_vault_config

    try:
        with Vault(vault_dir) as vault:
            check_vault_config(vault.config, vault.meta, vault.dir)
    except SmoeError as e:
        return [str(e)]
    return []


def cmd_inspect(args) -> int:
    from pathlib import Path

    from smoe.runtime.fit import disk_speed, fit_report, format_fit
    from smoe.source.inspect import DEFAULT_DISK_GBPS, at_disk_speed, format_report, inspect_path, model_config

    path = Path(resolve_model(args.path))
    report = inspect_path(path, num_experts=args.num_experts)
    disk = disk_speed(path, report, args.disk_gbps)
    report = at_disk_speed(report, disk["gbps"] or DEFAULT_DISK_GBPS)
    report["fit"] = fit_report(path, report, model_config(path), disk, args.ctx)
    print(json.dumps(report, indent=1) if args.json else format_report(report) + "\n" + format_fit(report["fit"]))
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
    from smoe.devices import set_torch_threads
    from smoe.runtime.model import OpenedVault

    set_torch_threads(args.torch_threads, "--torch-threads")
    cache = None if args.cache_gb is None else int(args.cache_gb * 1e9)
    gpu_cache = None if args.gpu_cache_gb is None else int(args.gpu_cache_gb * 1e9)
    return OpenedVault(args.vault, dtype=args.dtype, cache_bytes=cache, threads=args.threads,
                          direct_io=args.direct_io, device=args.device, gpu_cache_bytes=gpu_cache,
                          decoder=args.decoder)


def cmd_generate(args) -> int:
    from smoe.cli.chat import context_size
    from smoe.runtime.generate import TextStreamer, generate

    text = prompt_text(args)  # before the vault is opened: a missing prompt is a quick error
    sm = open_model(args)
    tok = load_tokenizer(args.vault)
    prompt = tok(check_text(text, "the prompt"), add_special_tokens=True)["input_ids"]
    streamer = None if args.json else TextStreamer(tok, sys.stdout)
    params = sampling_params(args, sm.vault.dir)
    max_tokens = args.max_tokens
    if args.ctx is not None:
        ctx = context_size(sm.max_positions, args.ctx)
        if len(prompt) >= ctx:
            raise SmoeError(f"the prompt is {len(prompt)} tokens, leaving no room in the context of {ctx} (-c)")
        max_tokens = min(max_tokens, ctx - len(prompt))
    tokens, stats = generate(sm, prompt, max_tokens, on_token=streamer, params=params)
    if args.json:
        print(json.dumps({"text": tok.decode(tokens, skip_special_tokens=True), "tokens": tokens,
                          "sampling": params.as_dict(), "stats": stats.as_dict(), **sm.describe()}))
    else:
        print(f"\n{stats.line()}\n[sampling: {params.line()}]", file=sys.stderr)
    return 0


def prompt_text(args) -> str:
    """The prompt of `smoe generate`: -p TEXT, -f FILE, or stdin when it is not a terminal."""
    if args.prompt is not None:
        return args.prompt
    if args.file is not None:
        with open(args.file, "rb") as f:
            raw = f.read()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SmoeError(f"{args.file}: not UTF-8 text (byte {e.start})") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise SmoeError("no prompt: give -p TEXT or -f FILE, or pipe it on stdin")
    return sys.stdin.read()


def cmd_chat(args) -> int:
    from smoe.cli import chat

    sm = open_model(args)
    return chat.run(sm, load_tokenizer(args.vault), args, sampling_params(args, sm.vault.dir))


def cmd_eval(args) -> int:
    from smoe.hf.model import check_reference
    from smoe.quality.evaluate import compare, load_reference
    from smoe.source.text import token_stream

    ref = resolve_model(args.ref)  # before the vault is opened: a missing model is a quick error
    sm = open_model(args)
    check_reference(ref, sm.config)
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
    from smoe.serve.api import Limits
    from smoe.serve.server import run_server

    limits = Limits(max_body_bytes=int(args.max_body_mb * 2**20), max_tokens=args.max_tokens, max_queue=args.max_queue,
                    idle_timeout=args.idle_timeout, request_timeout=args.request_timeout,
                    max_connections=args.max_connections, log_level=args.log_level)
    return run_server(lambda: open_model(args), load_tokenizer, args.vault, args.host, args.port, limits, args.api_key)


def add_quality_options(p: argparse.ArgumentParser) -> None:
    from smoe.convert.encoders import CALIB_TOKENS, DEFAULT, ENCODERS

    p.add_argument("--encoder", choices=ENCODERS, default=None,
                   help=f"how codes and scales are chosen (default: {DEFAULT} with --calib, grid without)")
    p.add_argument("--calib", metavar="TEXT_FILE", help="calibration text (.gz allowed); never the evaluation text")
    p.add_argument("--calib-tokens", type=numeric.COUNT.parse, default=None, help=f"calibration tokens (default {CALIB_TOKENS})")


def add_group_option(p: argparse.ArgumentParser, when: str = "") -> None:
    p.add_argument("--expert-groups", type=numeric.COUNT.parse, default=1, metavar="N",
                   help=f"{when}plan units finer than a fused tensor: each layer's experts in N groups by calibration "
                   "routing frequency, each group's gate_up and down at their own depth (default 1: whole tensors; "
                   "the expert count: one unit per expert); a tensor's measured KL is shared among its groups by "
                   "routed tokens x the encoder's weighted output error")


def add_runtime_options(p: argparse.ArgumentParser, dtype: str = "bfloat16") -> None:
    p.add_argument("vault", metavar="VAULT_DIR", nargs="?", help="the vault to run (made by `smoe quantize`)")
    p.add_argument("-m", "--model", dest="vault_option", metavar="VAULT_DIR", help="the vault, as llama-cli's -m "
                   "(instead of VAULT_DIR)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="cuda: trunk and expert cache on the GPU; auto (default): cuda when there is a GPU and its "
                   "fast decoder runs every layer of this vault on its kernels, else cpu (BENCHMARKS.md)")
    p.add_argument("--decoder", default="auto", choices=("auto", "fast", "generic"),
                   help="fast: the compiled decode step (the models it covers, e.g. Qwen3-MoE, Mixtral, DeepSeek-V3/V2); generic: the model's own transformers "
                   "modules (every family); auto (default): fast where the family has it")
    p.add_argument("--cache-gb", type=numeric.NON_NEGATIVE_REAL.parse, default=None,
                   help="expert cache budget in host RAM, GB (CPU default: half of the available RAM, at most all "
                   "experts; on a GPU it is a pinned host tier between disk and GPU, default none)")
    p.add_argument("--gpu-cache-gb", type=numeric.NON_NEGATIVE_REAL.parse, default=None,
                   help="GPU expert cache budget, GB (default: all experts if they fit in 80%% of the free GPU "
                   "memory, else that)")
    p.add_argument("--dtype", default=dtype, choices=("float32", "bfloat16"), help=f"compute dtype (default {dtype})")
    p.add_argument("--threads", "--io-threads", type=numeric.THREADS.parse, default=16,
                   help="reader threads: parallel expert reads from disk (default 16, for NVMe); the compute threads "
                   "are -t/--torch-threads")
    p.add_argument("--direct-io", action="store_true", help="read experts with O_DIRECT, bypassing the page cache")
    p.add_argument("-t", "--torch-threads", type=numeric.THREADS.parse, default=None,
                   help="threads for torch's CPU ops (default: OMP_NUM_THREADS when set, else 1 on machines of 2 "
                   "usable cores or fewer, where batch-1 ops are too small to split and a second thread mostly "
                   "waits, else all usable cores; smoe.load and from_pretrained take the same)")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=numeric.MAX_TOKENS.parse, default=128,
                   help="most new tokens to generate (default 128)")
    model = "default: the model's generation_config.json, else llama.cpp's"
    p.add_argument("--temperature", "--temp", type=numeric.TEMPERATURE.parse, help=f"0 = greedy ({model} 0.8)")
    p.add_argument("--top-p", type=numeric.TOP_P.parse, help=f"sample from the most likely tokens whose probabilities "
                   f"add up to this; 1 = off ({model} 0.95)")
    p.add_argument("--top-k", type=numeric.TOP_K.parse, help=f"sample from the K most likely tokens; 0 = off ({model} 40)")
    p.add_argument("--min-p", type=numeric.MIN_P.parse, help="keep tokens of at least this times the top "
                   f"token's probability; 0 = off ({model} 0.05)")
    p.add_argument("--repeat-penalty", type=numeric.REPETITION_PENALTY.parse,
                   help=f"divide seen tokens' positive logits by it, multiply negative ones; 1 = off ({model} 1)")
    p.add_argument("--frequency-penalty", type=numeric.PENALTY.parse,
                   help="subtract it times each token's count in the output so far (-2..2, default 0)")
    p.add_argument("--presence-penalty", type=numeric.PENALTY.parse,
                   help="subtract it from every token already in the output (-2..2, default 0)")
    p.add_argument("--seed", type=numeric.SEED.parse, help="the sampler's random seed (default: a random one, reported "
                   "by --json); the same seed gives the same tokens")


def sampling_params(args, vault_dir):
    """The sampler's settings: each option given replaces the default of the vault at `vault_dir`."""
    from smoe.runtime.sampling import chosen, sampling_defaults

    return chosen(sampling_defaults(vault_dir), temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  min_p=args.min_p, repetition_penalty=args.repeat_penalty, frequency_penalty=args.frequency_penalty,
                  presence_penalty=args.presence_penalty, seed=args.seed)


def cmd_bench(args) -> int:
    from smoe.bench import main as bench

    return bench.main(args)


def cmd_demo(args) -> int:
    from smoe.cli import demo

    return demo.main(args, run=main)


TOP_HELP = """\
Run Mixture-of-Experts models larger than RAM: the routed experts of a Hugging Face MoE checkpoint are
sealed into an SMOE-Q4/Q2 vault and streamed from disk through an expert cache.

  make a vault      quantize (seal a checkpoint), plan (a depth per tensor within a size budget)
  check it          inspect (what a model or vault costs, and whether it fits here), verify (checksums)
  run it            generate, chat, serve (OpenAI- and Anthropic-compatible HTTP, web chat)
  measure it        eval (perplexity and KL against the source), bench, test-quant (codec self-test)
  take it elsewhere export (GGUF for llama.cpp, MLX), dequantize (back to a HF checkpoint)
  try it            demo (all of the above on the small model shipped with smoe)

`smoe COMMAND --help` describes each command's options."""

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
    p = Parser(prog="smoe", formatter_class=argparse.RawDescriptionHelpFormatter, description=TOP_HELP)
    p.add_argument("--version", action="version", version=f"smoe {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    q = sub.add_parser("quantize", help="sculpt a HF MoE checkpoint into a vault",
                       description="Quantise the routed experts of MODEL (a HF model directory with safetensors) "
                       "into a vault; everything else is kept at source precision.")
    q.add_argument("model", metavar="MODEL_DIR", help=HUB_HELP + ", or a GGUF file (llama.cpp's; dequantised, except the SMOE groups of one `smoe export` wrote, kept as they are)")
    q.add_argument("-o", "--output", required=True, metavar="VAULT_DIR", help="the vault to write (a new directory)")
    q.add_argument("--bits", type=int, choices=(4, 2), default=4, help="SMOE-Q4 (default) or SMOE-Q2")
    q.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where calibration and the encoding run (default auto: a GPU when there is one)")
    q.add_argument("--force", action="store_true", help="replace an earlier output (a vault, or an empty directory) and discard a partial run")
    q.add_argument("--num-experts", type=numeric.COUNT.parse, help="experts per MoE layer, for checkpoints whose config lacks it")
    q.add_argument("--alignment", type=int, choices=(4096, 16384), default=4096,
                   help="blob alignment in bytes (16384 for 16 KiB-page systems)")
    q.add_argument("--json", action="store_true", help="print the summary as JSON")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    add_quality_options(q)
    q.add_argument("--plan", metavar="PLAN_JSON", help="depth per tensor from `smoe plan` (overrides --bits)")
    q.add_argument("--budget", type=numeric.BITS_PER_WEIGHT.parse, metavar="BITS", help="plan and write a mixed vault of at most BITS bits/weight "
                   "(scales included; needs --calib); plan, sensitivity table and heatmap go beside the vault")
    q.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS", help="encode the experts on a Ray cluster's workers, one MoE layer per task (and with --budget measure the sensitivity trials there, as smoe plan --ray); ADDRESS as for smoe plan")
    add_group_option(q, "with --budget: ")
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
    pl.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS", help="measure the sensitivity trials on a Ray cluster's workers (ADDRESS; without it a local cluster, one worker per core; needs pip install 'smoe[ray]')")
    add_group_option(pl)
    pl.add_argument("--layer-by-layer", action="store_true",
                    help="measure the sensitivity trials in one pass over the model run one decoder layer at a time "
                         "(memory: one layer and the windows' hidden states, on disk past 512 MiB), for models bigger "
                         "than memory; the calibration is streamed too and not kept beside the plan")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    pl.set_defaults(func=cmd_plan)

    v = sub.add_parser("verify", help="check every checksum and the index of a vault (exit 0 only if sound)")
    v.add_argument("vault", metavar="VAULT_DIR", help="the vault to check")
    v.add_argument("--json", action="store_true", help="print the problems found as JSON")
    v.set_defaults(func=cmd_verify)

    i = sub.add_parser("inspect", help="what a model or vault costs to stream, and whether it fits here",
                       description="PATH: a model directory, a directory with config.json + index, a bare "
                       "config.json, a GGUF file, a vault, or a hub id (ORG/NAME) already in the local Hugging Face cache.")
    i.add_argument("path", metavar="PATH", help="what to inspect (see above)")
    i.add_argument("--json", action="store_true", help="print the report as JSON")
    i.add_argument("--disk-gbps", type=numeric.BANDWIDTH_GBPS.parse, default=None,
                   help="disk read bandwidth in GB/s (default: measured once, reading up to 256 MB of the vault's experts "
                   "or the largest weight file with O_DIRECT; 7.4 where there is nothing to read)")
    i.add_argument("--num-experts", type=numeric.COUNT.parse, help="experts per MoE layer, for configs that lack it")
    i.add_argument("-c", "--ctx", type=numeric.COUNT.parse, metavar="N",
                   help="context length the KV cache is counted for (default: the model's, as `smoe chat` fills)")
    i.set_defaults(func=cmd_inspect)

    t = sub.add_parser("test-quant", help="codec self-test: SNR of both depths on a fixed Gaussian tensor",
                       description="Quantise a fixed-seed 128x64 Gaussian tensor at SMOE-Q2 and SMOE-Q4. RMSE and "
                       "absmax are the root-mean-square and the largest absolute reconstruction error.")
    t.add_argument("--json", action="store_true", help="print the result as JSON")
    t.set_defaults(func=cmd_test_quant)

    g = sub.add_parser("generate", help="generate text from a vault, experts streamed from disk")
    add_runtime_options(g)
    given = g.add_mutually_exclusive_group()
    given.add_argument("-p", "--prompt", help="the prompt (without -p or -f: read from stdin)")
    given.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE (UTF-8)")
    g.add_argument("-c", "--ctx", type=numeric.COUNT.parse, metavar="N",
                   help="tokens the prompt and the output may fill, at most the model's context (default: all of it)")
    add_sampling_options(g)
    g.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, stats")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with a vault")
    add_runtime_options(c)
    add_sampling_options(c)
    c.add_argument("--system", metavar="TEXT", help="the system prompt (in the chat: /system TEXT)")
    c.add_argument("-c", "--ctx", type=numeric.COUNT.parse, metavar="N",
                   help="tokens the conversation may fill, at most the model's context (default: all of it); "
                   "when full, the oldest exchanges are forgotten")
    c.set_defaults(func=cmd_chat)

    e = sub.add_parser("eval", help="perplexity, KL and top-1 agreement of a vault against its source model",
                       description="The first N tokens of FILE as one stream, no BOS, windows of 512, fp32 logits.")
    add_runtime_options(e, dtype="float32")
    e.add_argument("--ref", required=True, metavar="MODEL_DIR", help="the bf16 source model (" + HUB_HELP + ")")
    e.add_argument("--data", required=True, metavar="FILE", help="text file (.gz allowed)")
    e.add_argument("--tokens", type=numeric.EVAL_TOKENS.parse, default=16384, help="tokens of FILE to score (default 16384)")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.set_defaults(func=cmd_eval)

    dq = sub.add_parser("dequantize", help="write a HF checkpoint whose experts are the vault's decoded values")
    dq.add_argument("vault", metavar="VAULT_DIR", help="the vault to decode")
    dq.add_argument("-o", "--output", required=True, metavar="DIR", help="the HF checkpoint directory to write")
    dq.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="dtype of the decoded experts (default bfloat16)")
    dq.add_argument("--force", action="store_true", help="replace an earlier output (a directory with a config.json, or an empty one)")
    dq.set_defaults(func=cmd_dequantize)

    ex = sub.add_parser("export", help="write a vault as GGUF (llama.cpp) or as an mlx-lm model",
                        description="GGUF: one file, experts as Q4_1 (exact up to the fp16 rounding of each "
                        "scale), trunk at the vault's precision or as --trunk-type. MLX: a directory of safetensors shards, experts in "
                        "MLX affine form, trunk at the vault's precision.")
    ex.add_argument("vault", metavar="VAULT_DIR", help="the vault to export")
    ex.add_argument("--to", required=True, choices=("gguf", "mlx"), help="the format to write")
    ex.add_argument("-o", "--output", required=True, metavar="FILE_OR_DIR", help="the GGUF file or the MLX directory to write")
    ex.add_argument("--trunk-type", choices=("bf16", "f16", "f32", "q8_0"), default=None,
                    help="GGUF type of the trunk's matrices (default: the vault's own dtype, exact)")
    ex.add_argument("--force", action="store_true", help="replace an earlier output of the same kind (a GGUF file; an MLX directory)")
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
    sv.add_argument("--api-key", metavar="KEY", default=None, help="every /v1 route then needs Authorization: Bearer KEY (or x-api-key: KEY on /v1/messages); / and /health stay open")
    sv.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks (ratios against a baseline in the same process)")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    bq = bsub.add_parser("quantize", help="scale-search throughput in MB/s of bf16 input")
    bq.add_argument("--mb", type=numeric.POSITIVE_REAL.parse, default=96.0, help="MB of bf16 weights to encode per depth")
    bq.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the scale search runs (default auto)")
    bq.add_argument("--json", action="store_true", help="print the result as JSON")
    bs = bsub.add_parser("sculpt", help="peak RSS and throughput of `smoe quantize` on a synthetic checkpoint")
    bs.add_argument("--gb", type=numeric.POSITIVE_REAL.parse, default=4.0, help="size of the synthetic checkpoint in GB")
    bs.add_argument("--workdir", default=None, help="where to build it (default: a temporary directory)")
    bs.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the sculptor runs its search")
    bs.add_argument("--json", action="store_true", help="print the result as JSON")
    bk = bsub.add_parser("kernels", help="Triton expert kernels vs cuBLAS bf16 and torch int4 (effective GB/s, CUDA only)")
    bk.add_argument("--device", default="auto", choices=("auto", "cuda"), help="the GPU to measure on (default auto)")
    bk.add_argument("--shape", action="append", choices=("qwen3-235b-a22b", "qwen3-30b-a3b"),
                    help="expert shapes to measure (default: both)")
    bk.add_argument("--pool-gb", type=numeric.POSITIVE_REAL.parse, default=1.2, help="GB of distinct experts each variant rotates over")
    bk.add_argument("--json", action="store_true", help="print the result as JSON")
    br = bsub.add_parser("runtime", help="decode tok/s, hit rate, bytes read and peak RSS per cache budget (cold)")
    br.add_argument("vault", metavar="VAULT_DIR", help="the vault to decode from")
    br.add_argument("--ref", metavar="MODEL_DIR", help="also time transformers running this model resident in bf16")
    br.add_argument("--gguf", metavar="FILE", help="also time llama.cpp (llama-cpp-python) on this GGUF")
    br.add_argument("--budgets", default="0.05,0.25,1.0", help="cache budgets as fractions of all experts")
    br.add_argument("--tokens", type=numeric.COUNT.parse, default=128, help="tokens decoded per budget (default 128)")
    br.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="compute dtype (default bfloat16)")
    br.add_argument("--threads", type=numeric.THREADS.parse, default=1, help="parallel expert reads (default 1)")
    br.add_argument("--decoder", default="auto", choices=("auto", "fast", "generic"), help="as for generate (default auto)")
    br.add_argument("--memory-limit-gb", type=numeric.POSITIVE_REAL.parse, help="run smoe and llama.cpp inside a memory cgroup of this size")
    br.add_argument("--json", action="store_true", help="print the result as JSON")
    bsy = bsub.add_parser("runtime-synthetic", help="the expert store on a synthetic several-GB vault, skewed routing")
    bsy.add_argument("--workdir", default="out/bench", help="where the synthetic vault is built (kept for reruns)")
    bsy.add_argument("--layers", type=numeric.COUNT.parse, default=12, help="layers of 128 Qwen3-30B-A3B experts (12: 3.9 GB at Q4)")
    bsy.add_argument("--tokens", type=numeric.COUNT.parse, default=32, help="tokens decoded per budget (default 32)")
    bsy.add_argument("--budgets", default="0.05,0.25,1.0", help="cache budgets as fractions of all experts")
    bsy.add_argument("--json", action="store_true", help="print the result as JSON")
    bd = bsub.add_parser("decode", help="GPU decode tok/s of a Qwen3-30B-A3B- or DeepSeek-V2-Lite-shaped vault per GPU "
                         "cache budget, experts in host RAM or on disk, against transformers bf16 (CUDA only)")
    bd.add_argument("--model", default="qwen3-30b-a3b", choices=("qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b"),
                    help="the shapes of the synthetic vault (default qwen3-30b-a3b)")
    bd.add_argument("--workdir", default="out/bench-gpu", help="where the ~16 GB vault is built (kept for reruns)")
    bd.add_argument("--budgets", default="1.0,0.5,0.25,0.1", help="GPU cache budgets as fractions of all experts")
    bd.add_argument("--tokens", type=numeric.COUNT.parse, default=64, help="timed tokens per span")
    bd.add_argument("--repeats", type=numeric.COUNT.parse, default=3,
                    help="timed spans of --tokens per row, one after the other; a row gives their mean and spread "
                         "(as llama-bench's -r, which the comparison runs with 3; default 3)")
    bd.add_argument("--warmup", type=numeric.NON_NEGATIVE.parse, default=32, help="tokens decoded first, to bring the cache to steady state")
    bd.add_argument("--layers", type=numeric.COUNT.parse, default=None, help="fewer layers than the real 48 (quick checks)")
    bd.add_argument("--threads", type=numeric.THREADS.parse, default=16, help="parallel expert reads")
    bd.add_argument("--no-baseline", action="store_true", help="skip transformers bf16 resident on the GPU")
    bd.add_argument("--sources", default="host,disk", help="where a partial budget's misses come from: host, disk or "
                    "host,disk (default)")
    bd.add_argument("--routing", default="zipf", help="the recorded routing each row is timed under: zipf (skewed, as real routers; default), uniform (the worst case for a cache) or zipf,uniform")
    bd.add_argument("--host-misses", default="in-place", help="how a partial budget's misses from host RAM reach the "
                    "kernels: in-place (read by them over the link, default), copy (copied into the GPU cache first) "
                    "or in-place,copy")
    bd.add_argument("--llama-bench", metavar="PATH", default=None, help="llama.cpp's llama-bench (a CUDA build): also run "
                    "the model exported to GGUF, resident and with --n-cpu-moe for each partial budget")
    bd.add_argument("--prefill", default="", metavar="N,N", help="also time prompts of these lengths per budget "
                    "(and llama-bench -p N beside them), e.g. 512,2048,8192")
    bd.add_argument("--json", action="store_true", help="print the result as JSON")
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("demo", help="the main commands end to end on the small trained model shipped with smoe")
    d.add_argument("--workdir", default="out/demo", help="where the vaults go (default out/demo)")
    d.set_defaults(func=cmd_demo)
    for _ in subcommand_parsers(p):
        pass
    return p


def main(argv: list[str] | None = None) -> int:
    return guarded(build_parser, lambda parser: run(parser, argv))


def run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand that was given them, not by the top level
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    choose_vault(args)
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


def choose_vault(args) -> None:
    """The vault of a runtime command: VAULT_DIR or llama-cli's -m VAULT_DIR, exactly one of them."""
    if not hasattr(args, "vault_option"):
        return
    if args.vault and args.vault_option:
        args.parser.error("give the vault once: VAULT_DIR or -m VAULT_DIR, not both")
    args.vault = args.vault or args.vault_option
    if not args.vault:
        args.parser.error("the following arguments are required: VAULT_DIR (or -m VAULT_DIR)")


def resumable(args) -> str:
    """What an interrupted or failed write leaves: only quantize keeps a partial vault to resume, and
    only once it holds a blob."""
    from smoe.format.output import kept_partial

    if args.command != "quantize" or kept_partial(args.output) is None:
        return ""
    return " (the partial vault is kept; the same command resumes it)"


if __name__ == "__main__":
    sys.exit(main())
