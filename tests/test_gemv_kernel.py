"""The one-row projection kernel (smoe.runtime.cuda.gemv) computes F.linear: row counts that do not fill a
program's rows, row widths that are not a multiple of its step or a power of two, a bias, fp32 and bf16. Run
through the Triton interpreter in a child process (TRITON_INTERPRET must be set before triton is imported);
on a CUDA machine the GPU runtime's tests run it inside the decoder."""

import pytest

from smoe.testing.interpreted import interpreted_json

pytest.importorskip("triton", reason="triton not installed: the projection kernel cannot be checked")

CHILD = r"""
import json, sys
import torch
import torch.nn.functional as F
from smoe.runtime.cuda import gemv

assert gemv.ENABLED, "SMOE_GPU_GEMV=1 was not read"
out = {}
for case in json.loads(sys.argv[1]):
    torch.manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    x = torch.randn(1, case["k"]).to(dtype)
    w = (torch.randn(case["n"], case["k"]) / case["k"] ** 0.5).to(dtype)
    b = torch.randn(case["n"]).to(dtype) if case["bias"] else None
    assert gemv.covered(x, w)
    got, want = gemv.linear(x, w, b), F.linear(x.float(), w.float(), None if b is None else b.float())
    out[case["name"]] = {"error": float((got.float() - want).abs().max() / want.abs().max()),
                         "dtype": str(got.dtype), "shape": list(got.shape)}
# what the kernel does not take stays on F.linear, the same result
x2 = torch.randn(3, 64)
w2 = torch.randn(32, 64)
out["several rows"] = {"covered": gemv.covered(x2, w2), "equal": bool(torch.equal(gemv.linear(x2, w2), F.linear(x2, w2)))}
print(json.dumps(out))
"""

CASES = [
    dict(name="qkv-like: rows a multiple of the program's, width a multiple of the step", n=640, k=1024, bias=False,
         dtype="float32", seed=0),
    dict(name="router-like: few rows, bias", n=24, k=512, bias=True, dtype="float32", seed=1),
    dict(name="width not a power of two, rows not a multiple of the program's", n=1029, k=96 * 7, bias=True,
         dtype="float32", seed=2),
    dict(name="bf16", n=300, k=256, bias=False, dtype="bfloat16", seed=3),
    dict(name="many narrow rows (q/k/v's tiles), width not a multiple of the step", n=4100, k=320, bias=True,
         dtype="float32", seed=4),
]
BOUND = {"float32": 1e-5, "bfloat16": 1e-2}  # bf16: the output rounded to 8 bits


@pytest.fixture(scope="module")
def results():
    return interpreted_json(CHILD, CASES, SMOE_GPU_GEMV="1")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_one_row_projection_kernel_matches_f_linear(results, case):
    got = results[case["name"]]
    assert got["error"] < BOUND[case["dtype"]], got
    assert got["shape"] == [1, case["n"]] and got["dtype"] == f"torch.{case['dtype']}"


def test_several_rows_stay_on_f_linear(results):
    assert results["several rows"] == {"covered": False, "equal": True}
