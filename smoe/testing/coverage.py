"""The walk over every MoE family of the installed transformers: a tiny model of each, quantised,
verified, generated from and compared with transformers on the dequantised weights.

A family is a model_type with a causal-LM (or image-text-to-text) class whose modeling module defines
a routed-experts module (a class named ...Experts, ...SparseMoe..., ...MoE or ...MoeBlock). Its tiny
model is the hand-made one of smoe.testing.tiny_models where there is one, else transformers' default
config shrunk (tiny_default_config). `python -m smoe.testing.coverage [MODEL_TYPE...]` prints the table.
"""

from __future__ import annotations

import re
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from smoe.errors import SmoeError
from smoe.testing.tiny_models import TINY_CONFIGS, randomise, save_tiny_tokenizer, tiny_default_config, tiny_model

TOLERANCE = 1e-4  # fp32 logits, relative to their largest magnitude
MAX_PARAMETERS = 8_000_000  # tiny, vision towers fixed-width convolutions included; more: the shrink missed a size
_MOE_CLASS = re.compile(r"Experts|SparseMoe|MoE|Moe(Block|MLP|Layer)?$")
STAGES = ("build", "quantize", "verify", "open", "generate", "compare", "passed")


@dataclass
class Row:
    model_type: str
    stage: str  # the stage that failed, or "passed"
    decoder: str = ""  # the decoder that ran (fast | generic)
    error: str = ""  # one line
    relative_error: float | None = None

    @property
    def passed(self) -> bool:
        return self.stage == "passed"


def moe_model_types() -> list[str]:
    """Every MoE family's model_type in the installed transformers."""
    import sys

    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    classes = {**MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, **MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    found = []
    for model_type in sorted(set(CONFIG_MAPPING.keys()) & set(classes)):
        try:  # the module that defines the class (several types share llama's, data2vec-text has its own)
            module = sys.modules[getattr(transformers, classes[model_type]).__module__]
        except (ImportError, AttributeError):  # a family needing a package this machine lacks: walked, failing
            found.append(model_type)
            continue
        if any(isinstance(c, type) and issubclass(c, torch.nn.Module) and c.__module__ == module.__name__
               and _MOE_CLASS.search(n) for n, c in vars(module).items()) and (model_type in TINY_CONFIGS
                                                                               or _routes(model_type)):
            found.append(model_type)
    return found


def _routes(model_type: str) -> bool:
    """Whether the default config states an expert count (a dense stand-in of a MoE module does not; families
    whose default is dense, such as gemma4_text, are walked through their hand-made tiny model)."""
    from transformers import CONFIG_MAPPING

    from smoe.source.families import CONFIG_KEYS, NESTED_CONFIGS, _lookup

    config = CONFIG_MAPPING[model_type]().to_dict()
    nested = [config[k] for k in NESTED_CONFIGS if isinstance(config.get(k), dict)]
    return _lookup([*nested, config], CONFIG_KEYS["num_experts"]) is not None


def tiny_model_of(model_type: str, seed: int = 0):
    """A tiny fp32 model of `model_type`, every parameter random: the hand-made one where there is one."""

    if model_type in TINY_CONFIGS:
        return tiny_model(model_type, seed)
    config = tiny_default_config(model_type)
    auto = model_class(model_type)
    with torch.device("meta"):  # sized first: a size key the shrink does not know can leave a huge layer
        size = sum(p.numel() for p in auto.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise SmoeError(f"the shrunk config still has {size / 1e6:.0f}M parameters (a size key the shrink lacks)")
    torch.manual_seed(seed)
    return randomise(auto.from_config(config, dtype=torch.float32), seed).eval()


def model_class(model_type: str):
    """The Auto class of a family: its causal LM, else (a multimodal checkpoint) its image-text-to-text
    model, which smoe runs on text alone, its towers kept in the trunk."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModelForImageTextToText


def check(model_type: str, tmp: Path) -> Row:
    """One family through quantize -> verify -> open -> generate -> compare; the first failing stage."""
    from smoe.convert.dequantize import dequantize
    from smoe.convert.sculpt import sculpt
    from smoe.format.vault import verify
    from smoe.quality.evaluate import load_reference
    from smoe.runtime.generate import generate
    from smoe.runtime.model import OpenedVault

    row, sm = Row(model_type, "build"), None
    try:
        model = tiny_model_of(model_type)
        model.save_pretrained(tmp / "model")
        save_tiny_tokenizer(tmp / "model", model.config.get_text_config().vocab_size)
        row.stage = "quantize"
        sculpt(tmp / "model", tmp / "vault", bits=4, progress=False)
        row.stage = "verify"
        problems = verify(tmp / "vault")
        if problems:
            raise SmoeError(problems[0])
        row.stage = "open"
        sm = OpenedVault(tmp / "vault", dtype="float32")
        row.decoder = sm.decoder
        row.stage = "generate"
        ids = torch.randint(3, model.config.get_text_config().vocab_size, (1, 12),
                            generator=torch.Generator().manual_seed(1))
        tokens, _ = generate(sm, ids[0, :6].tolist(), max_tokens=4)
        if len(tokens) == 0:
            raise SmoeError("generate returned no tokens")
        row.stage = "compare"
        got = sm.logits(ids)[0]
        want = load_reference(dequantize(tmp / "vault", tmp / "reference", dtype=torch.float32))(ids)[0]
        row.relative_error = float((got - want).abs().max() / want.abs().max())
        if not row.relative_error <= TOLERANCE:
            raise SmoeError(f"logits {row.relative_error:.1e} from transformers' (tolerance {TOLERANCE})")
        row.stage = "passed"
    except Exception as e:  # noqa: BLE001 - every failure is a row of the table, named by its stage
        row.error = _one_line(e)
    finally:
        if sm is not None:
            sm.close()
    return row


def walk(model_types: list[str] | None = None) -> list[Row]:
    rows = []
    for model_type in model_types or moe_model_types():
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(check(model_type, Path(tmp)))
    return rows


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    where = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__}: {text[0][:160] if text else ''} ({Path(where.filename).name}:{where.lineno})"


def table(rows: list[Row]) -> str:
    lines = ["| model_type | result | decoder | detail |", "|---|---|---|---|"]
    for r in rows:
        result = "runs" if r.passed else f"fails at {r.stage}"
        detail = f"max error {r.relative_error:.1e}" if r.passed else r.error.replace("|", "/")
        lines.append(f"| `{r.model_type}` | {result} | {r.decoder} | {detail} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    from smoe.hf.bars import quiet_library_bars

    quiet_library_bars()
    result = walk(sys.argv[1:] or None)
    print(table(result))
    print(f"\n{sum(r.passed for r in result)} of {len(result)} run")
