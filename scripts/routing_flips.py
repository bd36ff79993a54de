"""How often quantising the routed experts flips routing, and whether calibrating on the quantised model's own
routing pays (QUALITY.md, "Better bits where they matter").

  python scripts/routing_flips.py OUT [--models a,b,c] [--eval-tokens 16384] [--calib-tokens 65536]

For each model, the source (fp32) and the same model with its routed experts encoded and decoded in memory
(smoe.quality.sensitivity.QuantisedModel: the weights a vault holds) score the first --eval-tokens tokens of
valid.txt.gz as `smoe eval` does (smoe.quality.evaluate.compare: windows of 512, KL(source ‖ quantised)).
Each MoE layer's top-k choice is recorded where the model gives it to its experts, from the model's own hidden
states: the routers stay at full precision, so a flip comes from the quantisation error upstream. A token's
top-1 is the expert of largest routing weight.

Variants: grid and the default gptq (statistics of smoe.convert.calibrate.collect on 65,536 tokens of
train.txt.gz, routed to each expert) at Q4 and Q2; and "propagated" gptq, whose second moments of each MoE
layer are collected with the layers before it already quantised (in order, each with its own propagated
statistics): every expert calibrated on the tokens the quantised model routes to it.

Statistics and results are cached under OUT (stats-*.pt, results.json): a re-run prints the tables at once.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from smoe.convert import calibrate
from smoe.hf.experts import experts_input_sizes
from smoe.hf.layerwise import batches
from smoe.hf.tokenizer import load_tokenizer
from smoe.quality.evaluate import compare
from smoe.quality.sensitivity import QuantisedModel
from smoe.source.text import token_stream, windows

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
MODELS = ("qwen3-moe-28m", "mixtral-28m-b", "deepseek-v3-30m")
TRAIN, VALID = SHARED / "corpus" / "train.txt.gz", SHARED / "corpus" / "valid.txt.gz"


class Stop(Exception):
    """Raised after the layer being calibrated: nothing later is needed."""


class Study:
    """One model: the source's logits and routes on the evaluation text, and quantised variants scored against them."""

    def __init__(self, model_dir: Path, out: Path, eval_tokens: int, calib_tokens: int):
        self.dir, self.out, self.calib_tokens = model_dir, out, calib_tokens
        self.qm = QuantisedModel(model_dir)
        self.routes: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.recording = True
        for layer, module in self.qm.modules.items():
            module.register_forward_pre_hook(functools.partial(self.record, layer))
        self.ids = token_stream(load_tokenizer(model_dir), VALID, eval_tokens)
        with torch.inference_mode():
            self.reference = [self.logits(w) for w in windows(self.ids)]
        self.reference_routes = self.take_routes()

    def record(self, layer: int, module, args) -> None:
        if self.recording:  # args: (hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k])
            self.routes.setdefault(layer, []).append((args[1].clone(), args[2].float().clone()))

    def take_routes(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        routes, self.routes = self.routes, {}
        return {layer: (torch.cat([i for i, _ in calls]), torch.cat([w for _, w in calls]))
                for layer, calls in sorted(routes.items())}

    def logits(self, window: torch.Tensor) -> torch.Tensor:
        return self.qm.model(input_ids=window, use_cache=False).logits.float()

    def evaluate(self, encoder: str, bits: int, stats=None, fresh: bool = True) -> dict:
        """KL etc. of every routed expert at `bits` by `encoder`, and per MoE layer the share of tokens whose top-k
        set and whose top-1 differ from the source's. `fresh`: encode again what is cached (other statistics)."""
        self.quantise_all(encoder, bits, stats, fresh=fresh)
        reference = iter(self.reference)
        with torch.no_grad():
            result = compare(self.logits, lambda _: next(reference), self.ids, progress=False)
        self.qm.set_plan({unit: None for unit in self.qm.units()})
        result["flips"] = flip_rates(self.reference_routes, self.take_routes())
        return result

    def quantise_all(self, encoder: str, bits: int | None, stats=None, layers=None, fresh: bool = True) -> None:
        self.qm.encoder, self.qm.stats = encoder, stats
        if fresh:
            self.qm.cache.clear()
        chosen = set(self.qm.expert_map.moe_layers if layers is None else layers)
        self.qm.set_plan({(layer, unit): bits if layer in chosen else None for layer, unit in self.qm.units()})

    def stats_path(self, name: str) -> Path:
        return self.out / f"stats-{self.dir.name}-{name}-{self.calib_tokens}.pt"

    def stats(self, name: str, make) -> calibrate.CalibrationStats:
        path = self.stats_path(name)
        stats = calibrate.CalibrationStats.load(path)
        if stats is None:
            start = time.perf_counter()
            stats = make()
            stats.save(path)
            log(f"{self.dir.name}: statistics {name} in {time.perf_counter() - start:.0f} s")
        return stats

    @functools.cached_property
    def base_stats(self) -> calibrate.CalibrationStats:
        """The default calibration's statistics (routed, PRIOR_TOKENS of prior), with every token's down inputs
        through every expert beside them (for calibration_balance.py; the default ignores them)."""
        stats = self.stats("base", lambda: calibrate.collect(self.dir, TRAIN, self.calib_tokens, progress=False,
                                                             balance=0.5))
        return stats

    def routed_stats(self, balance: float = 0.0) -> calibrate.CalibrationStats:
        return replace(self.base_stats, balance=balance)

    def evaluate_propagated(self, bits: int) -> dict:
        """evaluate() of gptq on propagated statistics; the layers encoded while collecting them are reused."""
        path = self.stats_path(f"propagated-q{bits}")
        stats = calibrate.CalibrationStats.load(path)
        fresh = stats is None
        if stats is None:
            start = time.perf_counter()
            stats = self.collect_propagated(bits)
            stats.save(path)
            first, base = stats.layers[0], self.base_stats.sums[stats.layers[0]]["gate_up"]
            drift = float((stats.sums[first]["gate_up"] - base).abs().max() / base.abs().max())
            log(f"{self.dir.name}: propagated statistics at Q{bits} in {time.perf_counter() - start:.0f} s (first MoE "
                f"layer's, upstream of any quantisation, vs the default's: max relative difference {drift:.1e})")
        return self.evaluate("gptq", bits, stats, fresh=fresh)

    def collect_propagated(self, bits: int) -> calibrate.CalibrationStats:
        """Each MoE layer's statistics with every MoE layer before it GPTQ-encoded at `bits` on its own
        propagated statistics: the tokens each expert sees are those the quantised model routes to it."""
        chunks = batches(calibrate.calibration_windows(self.dir, TRAIN, self.calib_tokens))
        stats = None
        self.qm.cache.clear()
        for layer in self.qm.expert_map.moe_layers:  # a layer's statistics never change once collected: cached codes
            self.quantise_all("gptq", bits, stats, stats.layers if stats else [], fresh=False)
            one = self.collect_layer(layer, chunks)
            stats = one if stats is None else stats.merge(one)
        return stats

    def collect_layer(self, layer: int, chunks: list[torch.Tensor]) -> calibrate.CalibrationStats:
        """One MoE layer's second moments, from the model as it is now, run up to that layer."""
        model, module = self.qm.model, self.qm.modules[layer]
        header = {"num_experts": module.num_experts, "tokens": sum(c.numel() for c in chunks),
                  "text_hash": calibrate.file_hash(TRAIN)}
        recorder = calibrate.Recorder(calibrate.CalibrationStats(**header), experts_input_sizes(module))
        decoder = model.get_decoder()
        stop = decoder.layers[layer].register_forward_hook(stop_here)
        implementation = model.config._experts_implementation
        model.set_experts_implementation(calibrate.IMPLEMENTATION)
        module.smoe_recorder, self.recording = recorder, False
        try:
            with torch.inference_mode():
                for ids in chunks:
                    try:
                        decoder(input_ids=ids, use_cache=False)
                    except Stop:
                        pass
        finally:
            stop.remove()
            del module.smoe_recorder
            self.recording = True
            model.set_experts_implementation(implementation)
        return recorder.stats


def stop_here(*_) -> None:
    raise Stop


def flip_rates(ref: dict, quant: dict) -> dict[int, dict[str, float]]:
    """Per MoE layer: share of tokens whose top-k expert set differs, and whose top-1 (largest weight) differs."""
    rates = {}
    for layer, (index, weights) in ref.items():
        q_index, q_weights = quant[layer]
        top1 = index.gather(1, weights.argmax(1, keepdim=True)) != q_index.gather(1, q_weights.argmax(1, keepdim=True))
        sets = (index.sort(1).values != q_index.sort(1).values).any(1)
        rates[layer] = {"set": float(sets.double().mean()), "top1": float(top1.double().mean())}
    return rates


def summary(flips: dict) -> tuple[float, float, float, int]:
    """(mean set-flip rate over layers, mean top-1 flip rate, worst layer's set-flip rate, that layer)."""
    layers = sorted(flips, key=int)
    worst = max(layers, key=lambda layer: flips[layer]["set"])
    mean = lambda k: sum(flips[layer][k] for layer in layers) / len(layers)
    return mean("set"), mean("top1"), flips[worst]["set"], int(worst)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cached(out: Path):
    """results.json as a dict, and a function that runs a measurement once and saves it under its name."""
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}

    def measure(name: str, run):
        if name not in results:
            start = time.perf_counter()
            results[name] = run()
            path.write_text(json.dumps(results, indent=1))
            r = results[name]
            log(f"{name}: KL {r['kl']:.5f} ({time.perf_counter() - start:.0f} s)")
        return results[name]

    return results, measure


def table(rows: list[tuple[str, str, int, dict]]) -> str:
    """rows: (model, variant, bits, result); KL also as a ratio to the model's default (gptq) at the same bits."""
    default = {(model, bits): r["kl"] for model, variant, bits, r in rows if variant == "gptq"}
    lines = ["| model | vault | KL | vs default | top-1 agreement | top-k set flips, mean | top-1 flips, mean "
             "| worst layer (set flips) |",
             "|---|---|---|---|---|---|---|---|"]
    for model, variant, bits, r in rows:
        s, t, worst, layer = summary(r["flips"])
        ratio = f"{r['kl'] / default[model, bits]:.3f}" if (model, bits) in default else ""
        lines.append(f"| {model} | {variant} Q{bits} | {r['kl']:.5f} | {ratio} | {r['top1']:.4f} | {s:.4f} | {t:.4f} "
                     f"| {worst:.4f} (layer {layer}) |")
    return "\n".join(lines)


def per_layer(rows: list[tuple[str, str, int, dict]]) -> str:
    return "\n".join(f"{model} {variant} Q{bits}: " + "  ".join(f"L{layer} {v['set']:.3f}/{v['top1']:.3f}"
                                                               for layer, v in r["flips"].items())
                     for model, variant, bits, r in rows)


def study_arguments(description: str) -> argparse.ArgumentParser:
    """The options both studies take (this script's and calibration_balance.py's)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("out", type=Path)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--calib-tokens", type=int, default=calibrate.DEFAULT_TOKENS)
    p.add_argument("--bits", default="4,2", help="depths to run, in this order")
    return p


def studies(args):
    """(cache key prefix, the model's Study made on first use) per model of --models."""
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        yield f"{name}|{args.eval_tokens}|{args.calib_tokens}", name, functools.cache(
            lambda name=name: Study(SHARED / "models" / name, args.out, args.eval_tokens, args.calib_tokens))


def main(argv=None) -> None:
    p = study_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--propagated-off", action="store_true", help="only grid and the default gptq")
    args = p.parse_args(argv)
    _, measure = cached(args.out)
    rows = []
    for tag, name, study in studies(args):
        variants = {"grid": lambda bits: study().evaluate("grid", bits),
                    "gptq": lambda bits: study().evaluate("gptq", bits, study().routed_stats())}
        if not args.propagated_off:
            variants["gptq propagated"] = lambda bits: study().evaluate_propagated(bits)
        for bits in map(int, args.bits.split(",")):
            for variant, run in variants.items():
                rows.append((name, variant, bits, measure(f"{tag}|{variant}|{bits}", lambda: run(bits))))
    print(table(rows))
    print("\nper MoE layer, top-k set flips / top-1 flips:")
    print(per_layer(rows))


if __name__ == "__main__":
    main()
