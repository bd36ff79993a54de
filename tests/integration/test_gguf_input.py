"""GGUF files as input, through the `smoe` command: one `smoe export` wrote quantizes back to a vault that
generates the same greedy tokens; one llama.cpp's own convert_hf_to_gguf.py wrote dequantises to the
weights transformers holds for the model it was converted from.

The converter is taken from llama-cpp-python's source release at the pinned version (the one that
`make test-integrations` installs), downloaded once with pip and kept under build/."""

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/export_models.py

from export_models import exportable_vault, save_exportable_model  # noqa: E402

from smoe.export.writer import export  # noqa: E402
from smoe.hf.gguf import trunk_names  # noqa: E402
from smoe.source.checkpoint import Checkpoint  # noqa: E402
from smoe.source.gguf import GgufCheckpoint  # noqa: E402
from smoe.source.matching import map_experts  # noqa: E402
from smoe.testing.tiny_models import TOKENIZER_TEXT  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def smoe_cli(*args):
    return subprocess.run([sys.executable, "-m", "smoe.cli", *map(str, args)], capture_output=True, text=True)


def pinned(package: str) -> str:
    text = (ROOT / "constraints.txt").read_text()
    return re.search(rf"^{package}==(\S+)$", text, re.M | re.I).group(1)


@pytest.fixture(scope="session")
def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py with its conversion/ and gguf-py/, from the pinned sdist."""
    version = pinned("llama_cpp_python")
    tree = ROOT / "build" / f"llama.cpp-convert-{version}"
    if (tree / "convert_hf_to_gguf.py").exists():
        return tree / "convert_hf_to_gguf.py"
    sdists = ROOT / "build" / "sdist"
    tarball = sdists / f"llama_cpp_python-{version}.tar.gz"
    if not tarball.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", sdists], check=True)
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(tarball) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(CONVERTER_PARTS) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tree, members=members, filter="data")
    return tree / "convert_hf_to_gguf.py"


def save_sentencepiece(model_dir: Path) -> None:
    """A tiny SentencePiece tokenizer.model: the converter accepts it (a byte-level BPE it would have to know by
    its hash) and writes it as llama.cpp's "llama" tokenizer."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter([TOKENIZER_TEXT] * 4), model_prefix=str(model_dir / "tokenizer"),
                                   vocab_size=60, hard_vocab_limit=False, model_type="unigram", minloglevel=2)
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer.vocab").unlink()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_exported_gguf_quantizes_to_a_vault_with_the_same_greedy_tokens(tmp_path, family):
    vault = exportable_vault(tmp_path, family, 4)
    path = export(vault, "gguf", tmp_path / "m.gguf")
    r = smoe_cli("quantize", path, "-o", tmp_path / "again", "--quiet")
    assert r.returncode == 0 and "notice" not in r.stderr, r.stderr
    runs = [smoe_cli("generate", v, "-p", "the sea was calm and", "-n", 24, "--temperature", 0, "--json")
            for v in (vault, tmp_path / "again")]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    tokens = [json.loads(r.stdout)["tokens"] for r in runs]
    assert tokens[0] == tokens[1] and len(tokens[0]) > 0
    inspected = smoe_cli("inspect", path, "--json", "--disk-gbps", "1")
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["family"] == family, inspected.stderr


# The converter takes a byte-level BPE tokenizer only when get_vocab_base_pre knows the hash of its output, and
# only released tokenizers (vocabularies of ~150k, more than a tiny model can carry) have one. So for Qwen3-MoE the
# real script runs with that one method replaced: it names the pre-tokenizer "qwen2", llama.cpp's name for
# Qwen2/Qwen3's split pattern, which the tiny tokenizer is built with; every tensor still goes through the
# converter's own code. Its "llama" architecture (Mixtral) takes a SentencePiece tokenizer.model as it is.
QWEN2_PRE_CONVERTER = """
import importlib.util, sys
from pathlib import Path
script = sys.argv.pop(1)
sys.path.insert(0, str(Path(script).parent))
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
convert = importlib.util.module_from_spec(spec)
spec.loader.exec_module(convert)
sys.modules["conversion"].TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
convert.main()
"""


def convertible_model(family: str, model_dir: Path, converter: Path) -> tuple[Path, list]:
    """A tiny model of `family` with a tokenizer the converter takes, and the command that converts it."""
    if family == "qwen3_moe":
        return save_exportable_model(family, model_dir, pre="qwen2"), [sys.executable, "-c", QWEN2_PRE_CONVERTER,
                                                                       converter]
    model = save_exportable_model(family, model_dir)
    save_sentencepiece(model)
    return model, [sys.executable, converter]


@pytest.mark.parametrize("outtype,tolerance", [("f32", 0.0), ("q8_0", 1 / 127)])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_gguf_llama_cpp_converted_dequantises_to_the_weights_transformers_holds(converter, tmp_path, family,
                                                                                   outtype, tolerance):
    model, command = convertible_model(family, tmp_path / "model", converter)
    path = tmp_path / f"{family}-{outtype}.gguf"
    r = subprocess.run([*command, model, "--outfile", path, "--outtype", outtype], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    source = Checkpoint(model)
    with GgufCheckpoint(path) as ckpt:
        ckpt.name_trunk(trunk_names(ckpt))
        assert set(ckpt.names()) == set(source.names())
        assert map_experts(ckpt.config, ckpt.names()).expert_names == map_experts(source.config, source.names()).expert_names
        for name in source.names():
            want, got = source.load(name).float(), ckpt.load(name).float()
            assert got.shape == want.shape, name
            # Q8_0 rounds each block of 32 to 127 steps of its largest magnitude; llama.cpp keeps norms in F32
            limit = tolerance * float(want.abs().max()) if ckpt.source_format(name).startswith("gguf_") else 0.0
            assert float((got - want).abs().max()) <= limit, name
