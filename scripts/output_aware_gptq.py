"""Whether GPTQ pays more when gate and up see the error the expert's output sees (QUALITY.md, "Weighting gate and
up by what follows them").

  python scripts/output_aware_gptq.py MODEL [--bits 4 2] [--tokens 65536] [--stats STATS.pt] [--eval-tokens 16384]

The default calibrated encoder weighs the error of every row of gate and up by the same second moment of the
expert's inputs, H = E[x xᵀ] over its routed tokens. What the expert outputs is down · (silu(g) ⊙ u): an error δu_i
in row i of up reaches the output as silu(g_i) δu_i, one δg_i in row i of gate as u_i silu'(g_i) δg_i, so a token
where silu(g_i) is near 0 cannot show an error of up's row i at all. Here each row of gate and up gets its own
second moment, H_i = E[w_i(x) x xᵀ] with w_i = silu(g_i)² (up) or (u_i silu'(g_i))² (gate) from the source
weights, blended with the default H as the default blends its prior (PRIOR_TOKENS tokens' worth), and is encoded
by the same GPTQ (one row a matrix). down keeps the default. Cross terms between rows (down's columns are not
orthogonal) are left out, as GPTQ leaves them out between rows.

Prints, as JSON lines, KL(source ‖ quantised) and top-1 agreement on the first --eval-tokens tokens of
valid.txt.gz (smoe.quality.evaluate.compare, as `smoe eval` scores a vault) for the default gptq and for the
row-weighted gate/up, each at every --bits.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from smoe.convert import calibrate
from smoe.convert.gptq import encode_gptq_batch
from smoe.format import codec
from smoe.hf.experts import register
from smoe.hf.tokenizer import load_tokenizer
from smoe.quality.evaluate import compare
from smoe.quality.sensitivity import QuantisedModel
from smoe.source.loading import load_projection
from smoe.source.text import token_stream, windows

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
TRAIN, VALID = SHARED / "corpus" / "train.txt.gz", SHARED / "corpus" / "valid.txt.gz"
CAPTURE = "smoe_capture_inputs"
ROWS_AT_ONCE = 32  # rows whose [in, in] second moments are built at once (memory: 32 · in² floats)


def capture_inputs(model_dir: Path, tokens: int) -> dict[tuple[int, int], torch.Tensor]:
    """(layer, expert) -> [n, hidden]: the hidden states calibration routes to each expert, source model in fp32."""
    seen: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)

    def forward(module, hidden_states, top_k_index, top_k_weights):
        def observe(e, which, x):
            if which == "gate_up":
                seen[(module.smoe_layer, e)].append(x.detach().clone())
        return calibrate.experts_forward(module, hidden_states, top_k_index, top_k_weights, observe)

    register(CAPTURE, forward)
    model, _ = calibrate.load_source_model(model_dir, CAPTURE)
    with torch.no_grad():
        for window in calibrate.calibration_windows(model_dir, TRAIN, tokens):
            model(input_ids=window, use_cache=False)
    return {k: torch.cat(v) for k, v in seen.items()}


def row_weights(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> dict[str, torch.Tensor]:
    """[n, rows] weight of each token in each row's error: silu(g)² for up, (u · silu'(g))² for gate."""
    g, u = x @ gate.T, x @ up.T
    sig = torch.sigmoid(g)
    return {"up": (g * sig) ** 2, "gate": (u * sig * (1 + g * (1 - sig))) ** 2}


def row_moments(x: torch.Tensor, weights: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
    """[rows, in, in]: Σ_t w_i(t) x_t x_tᵀ / n, plus the default second moment worth PRIOR_TOKENS tokens at row i's
    mean weight (so a row's few tokens do not decide it alone, as the default's prior does for an expert)."""
    n = x.shape[0]
    out = []
    for r0 in range(0, weights.shape[1], ROWS_AT_ONCE):
        w = weights[:, r0 : r0 + ROWS_AT_ONCE]
        sums = torch.einsum("tr,ti,tj->rij", w, x, x) / n
        prior = calibrate.PRIOR_TOKENS / n * w.mean(dim=0)[:, None, None] * default
        out.append(sums + prior)
    return torch.cat(out)


def token_moment(x: torch.Tensor, weights: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
    """[1, in, in]: one second moment for all rows, each token weighted by its mean over the rows of w_i / mean(w_i)
    (what a model too large for a moment per row could afford), with the default's prior as in row_moments."""
    w = (weights / weights.mean(dim=0).clamp(min=1e-30)).mean(dim=1)
    n = x.shape[0]
    return ((x * w[:, None]).T @ x / n + calibrate.PRIOR_TOKENS / n * default)[None]


def encode_rowwise(qm: QuantisedModel, inputs: dict, bits_list: list[int], variant: str = "rows") -> dict:
    """(layer, expert, role, bits) -> decoded [out, in] gate and up, each row by GPTQ on its own second moment
    (variant "rows") or the whole matrix on one token-weighted moment ("tokens")."""
    decoded = {}
    for (layer, e), x in sorted(inputs.items()):
        sources = {s.role: s for s in qm.expert_map.experts[(layer, e)]}
        weights = {role: load_projection(qm.ckpt, sources[role]).float() for role in ("gate", "up")}
        default = qm.stats.second_moment(layer, e, "gate")
        for role, w_rows in row_weights(x, weights["gate"], weights["up"]).items():
            w = weights[role]
            rows = variant == "rows"
            H = row_moments(x, w_rows, default) if rows else token_moment(x, w_rows, default)
            for bits in bits_list:
                packed, scales = encode_gptq_batch(w[:, None, :] if rows else w[None], H, bits)
                decoded[(layer, e, role, bits)] = decode_rows(packed, scales, bits, tuple(w.shape)) if rows else \
                    codec.decode(packed[0], scales[0], bits, tuple(w.shape))
    return decoded


def decode_rows(packed: torch.Tensor, scales: torch.Tensor, bits: int, shape: tuple[int, int]) -> torch.Tensor:
    """encode_gptq_batch's [rows, G, bytes] codes and [rows, G] scales of 1-row matrices -> the [out, in] matrix."""
    return torch.stack([codec.decode(packed[i], scales[i], bits, (1, shape[1]))[0] for i in range(shape[0])])


def score(qm: QuantisedModel, reference: dict, ids: list[int]) -> dict:
    def logits(w):
        return qm.model(input_ids=w, use_cache=False).logits.float()
    return compare(logits, lambda w: reference[tuple(w[0].tolist())], ids, progress=False)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--variant", choices=("rows", "tokens"), default="rows")
    p.add_argument("--stats", type=Path, help="calibration statistics saved by calibrate.CalibrationStats.save")
    args = p.parse_args(argv)
    model_dir = Path(args.model) if Path(args.model).is_dir() else SHARED / "models" / args.model
    start = time.perf_counter()
    if args.stats and args.stats.exists():
        stats = replace(calibrate.CalibrationStats.load(args.stats), balance=0.0)
    else:
        stats = calibrate.collect(model_dir, TRAIN, args.tokens, progress=False)
        if args.stats:
            stats.save(args.stats)
    qm = QuantisedModel(model_dir, "gptq", stats)
    ids = token_stream(load_tokenizer(model_dir), VALID, args.eval_tokens)
    with torch.no_grad():
        reference = {tuple(w[0].tolist()): qm.model(input_ids=w, use_cache=False).logits.float() for w in windows(ids)}
    inputs = capture_inputs(model_dir, args.tokens)
    rowwise = encode_rowwise(qm, inputs, args.bits, args.variant)
    print(json.dumps({"model": model_dir.name, "encoded_s": round(time.perf_counter() - start)}), flush=True)
    for bits in args.bits:
        with torch.no_grad():
            qm.set_plan({unit: bits for unit in qm.units()})
            base = score(qm, reference, ids)
            saved = {k: v for k, v in qm.cache.items() if k[3] == bits and k[2] in ("gate", "up")}
            qm.cache.update({k: v for k, v in rowwise.items() if k[3] == bits})
            qm.set_plan({unit: bits for unit in qm.units()})
            new = score(qm, reference, ids)
            qm.cache.update(saved)
        print(json.dumps({"model": model_dir.name, "bits": bits, "gptq": base, args.variant: new,
                          "ratio": round(new["kl"] / base["kl"], 4), "seconds": round(time.perf_counter() - start)}),
              flush=True)


if __name__ == "__main__":
    main()
