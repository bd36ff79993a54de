"""Expert-balanced calibration: each expert's second moments from the tokens routed to it (smoe's default, with
its PRIOR_TOKENS prior) against llm-compressor's rule (every calibration token through every expert, for the
statistics only) and an even mix (QUALITY.md, "Better bits where they matter").

  python scripts/calibration_balance.py OUT [--models a,b,c] [--eval-tokens 16384] [--calib-tokens 65536]

The statistics are smoe.convert.calibrate.collect(..., balance=b): H = (1 - b)·routed + b·every-token, per
token; b = 0 is the default, 1 llm-compressor's rule (gate/up: every expert gets the layer's input moment;
down: each expert's activation of every token). GPTQ at Q4 and Q2, scored as routing_flips.py scores (and
sharing its cache: run both with the same OUT and token counts).
"""

from __future__ import annotations

from routing_flips import cached, per_layer, studies, study_arguments, table

BALANCES = {"gptq": 0.0, "gptq balance 0.5": 0.5, "gptq every token": 1.0}


def main(argv=None) -> None:
    p = study_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--balances", default=",".join(BALANCES), help="which of the variants to run")
    args = p.parse_args(argv)
    _, measure = cached(args.out)
    rows = []
    for tag, name, study in studies(args):
        for bits in map(int, args.bits.split(",")):
            for variant in args.balances.split(","):
                b = BALANCES[variant]
                rows.append((name, variant, bits, measure(
                    f"{tag}|{variant}|{bits}", lambda: study().evaluate("gptq", bits, study().routed_stats(b)))))
    print(table(rows))
    print("\nper MoE layer, top-k set flips / top-1 flips:")
    print(per_layer(rows))


if __name__ == "__main__":
    main()
