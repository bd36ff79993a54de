"""A GGUF opened for quantizing: its trunk named as transformers' checkpoints name it, its tokenizer rebuilt
by transformers' own GGUF tokenizer loader and saved as tokenizer.json beside the config.

The names come from the model transformers builds for the GGUF's config (on the meta device), as
save_pretrained would write them, each sent through the export's llama.cpp name table: the table read
backwards, for the names this model has.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer
from transformers.core_model_loading import revert_weight_conversion

from smoe.errors import SmoeError
from smoe.hf.model import build_model, read_config
from smoe.source.checkpoint import Checkpoint
from smoe.source.gguf import GgufCheckpoint, is_gguf, tensor_name_map
from smoe.source.matching import map_experts


def open_source(path, calibrated: bool = False):
    """The checkpoint at `path`: a GGUF file, or a Hugging Face model directory. `calibrated`: an encoder
    will run the model on calibration text, which transformers cannot do from a GGUF MoE."""
    if not is_gguf(path):
        return Checkpoint(path)
    if calibrated:
        check_calibratable(path)
    return open_gguf(path)


def check_calibratable(path) -> None:
    """Refuse calibrating on a GGUF before anything runs."""
    if is_gguf(path):
        raise SmoeError(f"{path}: calibration (--calib, --budget, smoe plan) runs the model through transformers, which "
                        f"cannot load a GGUF mixture of experts; quantize it without calibration, or calibrate on "
                        f"the Hugging Face checkpoint")


def open_gguf(path) -> GgufCheckpoint:
    ckpt = GgufCheckpoint(path)
    try:
        ckpt.name_trunk(trunk_names(ckpt))
        save_tokenizer(ckpt)
    except BaseException:
        ckpt.close()
        raise
    return ckpt


def trunk_names(ckpt: GgufCheckpoint) -> dict[str, str]:
    """llama.cpp name -> checkpoint name of every trunk tensor of the model the config builds."""
    where = f"{ckpt.location} (its metadata as a config)"
    model = build_model(read_config(ckpt.config, where), torch.float32, streaming=False, where=where)
    names = list(revert_weight_conversion(model, model.state_dict()))
    experts = map_experts(ckpt.config, names).expert_names
    table = tensor_name_map(ckpt.arch, ckpt.config["num_hidden_layers"])
    present = set(ckpt.gguf_names())
    found = {}
    for name in names:
        if name in experts or name.endswith("rotary_emb.inv_freq"):
            continue
        llama = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if llama in present:
            found[llama] = name
        elif not (name == "lm_head.weight" and ckpt.config.get("tie_word_embeddings")):
            raise SmoeError(f"{ckpt.location}: no tensor {llama or name} (the model's {name})")
    return found


def save_tokenizer(ckpt: GgufCheckpoint) -> None:
    """The GGUF's tokenizer as transformers rebuilds it from the metadata, saved into the checkpoint's directory.
    The file is linked there, so that no tokenizer file that happens to lie beside the GGUF is read."""
    link = ckpt.dir / Path(ckpt.location).name
    link.symlink_to(Path(ckpt.location).resolve())
    kind = ckpt.tokenizer_model()
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its notes on unused metadata keys are not the user's concern
    try:
        tokenizer = AutoTokenizer.from_pretrained(ckpt.dir, gguf_file=link.name)
        tokenizer.save_pretrained(ckpt.dir)
    except Exception as e:  # the converters raise KeyError, ValueError, NotImplementedError...
        raise SmoeError(f"{ckpt.location}: smoe cannot rebuild its tokenizer (tokenizer.ggml.model {kind!r}; "
                        f"{type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    finally:
        logger.setLevel(level)
        link.unlink()
