"""What opening a vault costs: `Vault` (header, index, small-file checksums) and `smoe.load` (also the config
checks, the meta-device model and the trunk) on a tiny Qwen3-MoE vault this tree quantizes, as medians.
Usage: python scripts/open_cost.py OUT REPEATS (run with PYTHONPATH set to another checkout to time that one)"""

import statistics
import sys
import time
import warnings
from pathlib import Path

import smoe
from smoe.format.vault import Vault
from smoe.testing.vaults import tiny_model_dir, vault_of

warnings.filterwarnings("ignore")
out, repeats = Path(sys.argv[1]), int(sys.argv[2])
if not (out / "vault").exists():
    out.mkdir(parents=True, exist_ok=True)
    vault_of(tiny_model_dir(out, "qwen3_moe"), out / "vault")
v = out / "vault"
smoe.load(v).smoe_runtime.close()  # warm: imports, numba
t_vault, t_load = [], []
for _ in range(repeats):
    t = time.perf_counter()
    Vault(v).close()
    t_vault.append(time.perf_counter() - t)
    t = time.perf_counter()
    model = smoe.load(v, dtype="float32")
    t_load.append(time.perf_counter() - t)
    model.smoe_runtime.close()
print(f"{smoe.__file__}: Vault {1e3 * statistics.median(t_vault):.2f} ms, "
      f"smoe.load {1e3 * statistics.median(t_load):.1f} ms (median of {repeats})")
