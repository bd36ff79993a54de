"""gpt-oss on the GPU: greedy decode tok/s of the fast decoder (Triton kernels with expert biases and the
clamped SwiGLU, sinks and windows in its GQA block, CUDA graphs) against the generic one (transformers'
modules), alternating, on a random gpt-oss of a small shape; and their greedy tokens compared.

    python3 scripts/h200_gpt_oss.py OUT_DIR [hidden] [layers] [experts]
"""

import json
import sys
import tempfile
from pathlib import Path

from smoe.convert.sculpt import sculpt
from smoe.runtime.generate import generate
from smoe.runtime.model import OpenedVault
from smoe.runtime.sampling import SamplingParams
from smoe.testing.tiny_models import save_tiny_model


def main(out: Path, hidden: int = 1024, layers: int = 8, experts: int = 32) -> None:
    tmp = Path(tempfile.mkdtemp())
    save_tiny_model("gpt_oss", tmp / "model", hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
                    num_local_experts=experts, num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=64, vocab_size=32000, sliding_window=128, max_position_embeddings=4096,
                    layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    sculpt(tmp / "model", tmp / "vault", bits=4, progress=False)
    prompt, greedy = list(range(100, 164)), SamplingParams(temperature=0.0)
    result = {"shape": dict(hidden=hidden, layers=layers, experts=experts, top_k=4)}
    opened = {name: OpenedVault(tmp / "vault", dtype="bfloat16", device="cuda", decoder=name) for name in ("fast", "generic")}
    for name, sm in opened.items():  # warm-up: compiles, captures graphs
        generate(sm, prompt, max_tokens=8, params=greedy)
    for round_ in range(3):
        for name, sm in opened.items():
            tokens, stats = generate(sm, prompt, max_tokens=256, params=greedy)
            result.setdefault(name, []).append(round(stats.decode_tok_s, 1))
            result.setdefault(f"{name}_tokens", tokens)
            result[f"{name}_decoder"] = sm.describe()
    fast, generic = result["fast_tokens"], result["generic_tokens"]
    result["tokens_equal_first"] = next((i for i, (a, b) in enumerate(zip(fast, generic)) if a != b), len(fast))
    del result["fast_tokens"], result["generic_tokens"]
    print(json.dumps(result))
    (out / "gpt_oss_gpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *map(int, sys.argv[2:]))
