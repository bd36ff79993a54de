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
    gpu_decoder: str = ""  # the one `--decoder auto` takes on an NVIDIA GPU, by the description's gaps
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

    from smoe.source.config_numbers import CONFIG_KEYS, NESTED_CONFIGS, lookup

    config = CONFIG_MAPPING[model_type]().to_dict()
    nested = [config[k] for k in NESTED_CONFIGS if isinstance(config.get(k), dict)]
    return lookup([*nested, config], CONFIG_KEYS["num_experts"]) is not None


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


def check(model_type: str, tmp: Path, device: str = "cpu") -> Row:
    """One family through quantize -> verify -> open (on `device`) -> generate -> compare; the first failing stage."""
    from smoe.convert.dequantize import dequantize
    from smoe.convert.sculpt import sculpt
    from smoe.format.vault import verify
    from smoe.quality.evaluate import load_reference
    from smoe.runtime.generate import generate
    from smoe.runtime.model import OpenedVault
    from smoe.runtime.weights import fast_decoder_gap

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
        sm = OpenedVault(tmp / "vault", dtype="float32", device=device)
        row.decoder = sm.decoder
        row.gpu_decoder = "generic" if fast_decoder_gap(sm.description, "cuda") else "fast"
        row.stage = "generate"
        ids = torch.randint(3, model.config.get_text_config().vocab_size, (1, 12),
                            generator=torch.Generator().manual_seed(1))
        tokens, _ = generate(sm, ids[0, :6].tolist(), max_tokens=4)
        if len(tokens) == 0:
            raise SmoeError("generate returned no tokens")
        row.stage = "compare"
        want = load_reference(dequantize(tmp / "vault", tmp / "reference", dtype=torch.float32))(ids)[0]
        row.relative_error = max(float((got - want).abs().max() / want.abs().max())
                                 for got in (sm.logits(ids)[0], stepwise_logits(sm, ids[0].tolist())))
        if not row.relative_error <= TOLERANCE:
            raise SmoeError(f"logits {row.relative_error:.1e} from transformers' (tolerance {TOLERANCE})")
        row.stage = "passed"
    except Exception as e:  # noqa: BLE001 - every failure is a row of the table, named by its stage
        row.error = _one_line(e)
    finally:
        if sm is not None:
            sm.close()
    return row


def stepwise_logits(sm, tokens: list[int], prompt: int = 6) -> torch.Tensor:
    """Logits of a prompt's prefill, then of each further token decoded one step at a time (the decode
    step a decoder runs in generate, with its KV cache), through the decoder contract."""
    from smoe.runtime.decoder import SequenceStep, open_decoder

    decoder = open_decoder(sm, "auto", len(tokens))
    rows = [decoder.forward([SequenceStep(0, tokens[:prompt], 0)])[0]]
    rows += [decoder.forward([SequenceStep(0, [t], i)])[0] for i, t in enumerate(tokens[prompt:], prompt)]
    decoder.release(0)
    return torch.cat(rows)


def walk(model_types: list[str] | None = None, device: str = "cpu") -> list[Row]:
    rows = []
    for model_type in model_types or moe_model_types():
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(check(model_type, Path(tmp), device))
    return rows


def decode_speeds(model_type: str, tmp: Path, tokens: int = 64, rounds: int = 3) -> dict[str, list[float]]:
    """decoder -> greedy decode tok/s of the family's tiny vault, `rounds` rounds alternating the fast and the
    generic decoder in this process (one warm-up generation each first: numba compiles on first use)."""
    from smoe.convert.sculpt import sculpt
    from smoe.runtime.generate import generate
    from smoe.runtime.model import OpenedVault
    from smoe.runtime.sampling import SamplingParams

    tiny_model_of(model_type).save_pretrained(tmp / "model")
    sculpt(tmp / "model", tmp / "vault", bits=4, progress=False)
    speeds = {"fast": [], "generic": []}
    opened = {name: OpenedVault(tmp / "vault", dtype="float32", decoder=name, threads=1) for name in speeds}
    greedy = SamplingParams(temperature=0.0)
    try:
        for name, sm in opened.items():
            generate(sm, [3, 4, 5, 6], max_tokens=4, params=greedy)
        for _ in range(rounds):
            for name, sm in opened.items():
                _, stats = generate(sm, [3, 4, 5, 6], max_tokens=tokens, params=greedy)
                speeds[name].append(stats.decode_tok_s)
    finally:
        for sm in opened.values():
            sm.close()
    return speeds


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    where = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__}: {text[0][:160] if text else ''} ({Path(where.filename).name}:{where.lineno})"


# Why a family the walk cannot run is left out, where it is not a bug to fix (the walk's own detail
# says where it stopped).
LEFT_OUT = {
    "doge": "its experts are rows of an embedding table chosen by product keys, not matrices",
    "jetmoe": "mixture-of-attention experts beside the MLP experts, in modules found by neither name nor shape",
    "ernie4_5_vl_moe": "text and vision experts side by side in every MoE layer (numbered in one table in the "
                       "release, split by transformers' converter); a vault holds one experts module per layer",
}


def table(rows: list[Row]) -> str:
    lines = ["| model_type | result | decoder | detail |", "|---|---|---|---|"]
    for r in rows:
        result = "runs" if r.passed else f"fails at {r.stage}"
        detail = f"max error {r.relative_error:.1e}" if r.passed else r.error.replace("|", "/")
        if not r.passed and r.model_type in LEFT_OUT:
            detail = f"{LEFT_OUT[r.model_type]}. {detail}"
        lines.append(f"| `{r.model_type}` | {result} | {r.decoder} | {detail} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    causal = set(causal_lm_types())
    ran = [r for r in rows if r.passed]
    return (f"{len(ran)} of {len(rows)} run ({sum(r.decoder == 'fast' for r in ran)} on the fast decoder); of the "
            f"{len(causal & {r.model_type for r in rows})} with a causal-LM class, "
            f"{sum(r.model_type in causal for r in ran)} run")


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def decoders_table(rows: list[Row], gpu_rows: list[Row] | None = None) -> str:
    """Per family that runs, the decoder `--decoder auto` takes on each device: the CPU's as the walk ran it;
    the GPU's as a walk on a GPU ran it (`gpu_rows`: its --json), else from the description's gaps
    (smoe.runtime.weights.fast_decoder_gap)."""
    measured = {r.model_type: r for r in gpu_rows or []}

    def gpu(r: Row) -> str:
        if r.model_type not in measured:
            return f"{r.gpu_decoder} (by its description)"
        g = measured[r.model_type]
        return g.decoder if g.passed else f"fails at {g.stage}: {g.error[:80]}"

    lines = ["| model_type | CPU | NVIDIA GPU |", "|---|---|---|"]
    lines += [f"| `{r.model_type}` | {r.decoder} | {gpu(r)} |" for r in rows if r.passed]
    return "\n".join(lines)


README_START = "<!-- family table: python -m smoe.testing.coverage --write --gpu-rows docs/walk-h200.json -->"
README_END = "<!-- end of family table -->"


def write(rows: list[Row], root: Path, gpu_rows: list[Row] | None = None) -> None:
    """docs/FAMILIES.md, and the README's per-family decoder table between its markers."""
    import transformers

    (root / "docs" / "FAMILIES.md").write_text(FAMILIES_HEADER.format(version=transformers.__version__)
                                               + table(rows) + f"\n\n{summary(rows)}\n")
    readme = (root / "README.md").read_text()
    head, rest = readme.split(README_START)
    _, tail = rest.split(README_END)
    gpu = f" On an NVIDIA GPU: {summary(gpu_rows)}." if gpu_rows else ""
    (root / "README.md").write_text(f"{head}{README_START}\nOn the CPU: {summary(rows)}.{gpu}\n\n"
                                    f"{decoders_table(rows, gpu_rows)}\n{README_END}{tail}")


FAMILIES_HEADER = """# MoE families of transformers {version} in smoe

Written by `python -m smoe.testing.coverage --write` (this CPU machine): every model_type of the pinned
transformers with a causal-LM or image-text-to-text class whose own modeling module defines a routed-experts
module (and whose default config states an expert count, or which has a hand-made tiny model), as a tiny random
model: transformers' default config shrunk (smoe.testing.tiny_models.tiny_default_config: small sizes, one
decoder layer of each kind, towers of one small layer), quantised to SMOE-Q4, verified, opened, generated from,
and its fp32 logits compared with transformers' on the dequantised weights (at most 1e-4 relative). "decoder"
names the decoder `--decoder auto` chose on the CPU; "fails at" names the first stage that failed, why, and
where the family is left out on purpose, the reason. `make test-integrations` runs the walk and fails when a
family that runs here stops running, or when transformers adds or drops a family this table does not list.

Multimodal checkpoints (image-text-to-text classes) run their text through that class, their vision and audio
towers kept unquantised in the trunk. Families without a row in smoe's table run when transformers builds their
routed experts as one fused module (smoe.hf.discover): the release's own expert layout is read from
transformers' save-time conversion, the trunk is loaded through its load-time converters.

"""


def speed_table(rows: list[Row]) -> str:
    lines = ["| model_type | fast tok/s | generic tok/s | fast / generic (median of rounds) |", "|---|---|---|---|"]
    for r in rows:
        if r.decoder == "fast":
            with tempfile.TemporaryDirectory() as tmp:
                v = decode_speeds(r.model_type, Path(tmp))
            ratio = sorted(f / g for f, g in zip(v["fast"], v["generic"]))[len(v["fast"]) // 2]
            lines.append(f"| `{r.model_type}` | {' / '.join(f'{x:.0f}' for x in v['fast'])} | "
                         f"{' / '.join(f'{x:.0f}' for x in v['generic'])} | {ratio:.1f}x |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    import argparse
    import json
    from dataclasses import asdict

    from smoe.hf.bars import quiet_library_bars

    p = argparse.ArgumentParser(prog="python -m smoe.testing.coverage", description=__doc__.splitlines()[0])
    p.add_argument("model_types", nargs="*", help="default: every MoE family of the installed transformers")
    p.add_argument("--device", default="cpu", help="where the vaults are opened (cuda: the GPU decoders)")
    p.add_argument("--speed", action="store_true", help="fast / generic decode speed of each family that runs fast")
    p.add_argument("--json", type=Path, help="write the rows there")
    p.add_argument("--write", action="store_true", help="write docs/FAMILIES.md and the README's table (whole walk)")
    p.add_argument("--gpu-rows", type=Path, help="with --write: the --json of a walk on a GPU, for the GPU column")
    args = p.parse_args(argv)
    quiet_library_bars()
    rows = walk(args.model_types or None, args.device)
    if args.speed:
        print(speed_table(rows))
        return
    print(table(rows))
    print(f"\n{summary(rows)}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.write and not args.model_types:
        gpu_rows = [Row(**r) for r in json.loads(args.gpu_rows.read_text())] if args.gpu_rows else None
        write(rows, Path(__file__).resolve().parents[2], gpu_rows)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
