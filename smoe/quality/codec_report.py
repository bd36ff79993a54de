"""`smoe test-quant`: the codecs' quality on a fixed Gaussian tensor, against absmax scaling."""

from __future__ import annotations

import torch

from smoe.format import codec

SHAPE = (128, 64)
SEED = 0
SNR_FLOOR_DB = {2: 9.0, 4: 19.5}  # grid search on Gaussian data gives about 9.5 / 20.6 dB
MIN_GAIN_OVER_ABSMAX_DB = {2: 3.0, 4: 0.3}


def measure(bits: int, w: torch.Tensor) -> dict:
    approx = codec.decode(*codec.encode(w, bits), bits, w.shape)
    baseline = codec.decode(*codec.encode_absmax(w, bits), bits, w.shape)
    err = (w - approx).double()
    return {
        "bits": bits,
        "rmse": float(err.pow(2).mean().sqrt()),
        "absmax": float(err.abs().max()),
        "snr_db": codec.snr_db(w, approx),
        "absmax_snr_db": codec.snr_db(w, baseline),
    }


def failures(row: dict) -> list[str]:
    bits, out = row["bits"], []
    if row["snr_db"] < SNR_FLOOR_DB[bits]:
        out.append(f"SMOE-Q{bits} SNR {row['snr_db']:.2f} dB below the floor {SNR_FLOOR_DB[bits]} dB")
    gain = row["snr_db"] - row["absmax_snr_db"]
    if gain < MIN_GAIN_OVER_ABSMAX_DB[bits]:
        out.append(f"SMOE-Q{bits} scale search gains {gain:.2f} dB over absmax, needs {MIN_GAIN_OVER_ABSMAX_DB[bits]} dB")
    return out


def run() -> tuple[list[dict], list[str]]:
    w = torch.randn(SHAPE, generator=torch.Generator().manual_seed(SEED))
    rows = [measure(bits, w) for bits in (2, 4)]
    return rows, [f for r in rows for f in failures(r)]


def format_row(row: dict) -> str:
    return (
        f"SMOE-Q{row['bits']}  RMSE={row['rmse']:.4f}  absmax={row['absmax']:.4f}  SNR={row['snr_db']:.2f} dB"
        f"  (absmax scaling: {row['absmax_snr_db']:.2f} dB)"
    )
