"""The sensitivity sweep's trials measured two ways on one model: in one pass over the source run one decoder
layer at a time (smoe.quality.sensitivity.measure_layer_by_layer, what `smoe plan --layer-by-layer` runs) and with
the whole model loaded (the KL meter), every (MoE layer, unit, depth) of the grid encoder on the first 8
calibration windows (512 tokens each) of TEXT. Prints both wall times and the largest relative difference.

Usage: python scripts/sweep_layer_by_layer.py MODEL_DIR TEXT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smoe.convert import calibrate  # noqa: E402
from smoe.quality.sensitivity import (  # noqa: E402
    SENSITIVITY_WINDOWS,
    KLMeter,
    QuantisedModel,
    measure_layer_by_layer,
    measure_one,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("text")
    args = ap.parse_args()
    windows = calibrate.calibration_windows(args.model, args.text, 4096)[:SENSITIVITY_WINDOWS]
    qm = QuantisedModel(args.model, "grid")
    trials = [(layer, unit, bits) for layer, unit in qm.units() for bits in (2, 4)]
    start, layered = time.perf_counter(), {}
    measure_layer_by_layer(qm, windows, trials, layered.__setitem__)
    layered_s = time.perf_counter() - start
    start = time.perf_counter()
    meter = KLMeter(QuantisedModel(args.model, "grid"), windows)
    whole = {trial: measure_one(meter, *trial) for trial in trials}
    whole_s = time.perf_counter() - start
    worst = max(abs(layered[t] / whole[t] - 1) for t in trials)
    print(f"{len(trials)} trials: layer by layer {layered_s:.1f} s, whole model {whole_s:.1f} s; "
          f"largest relative difference {worst:.2e}")
    for trial in trials:
        print(f"  {trial}: {whole[trial]:.9f} / {layered[trial]:.9f}")


if __name__ == "__main__":
    main()
