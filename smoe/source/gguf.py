"""A GGUF file (llama.cpp's format) read as a checkpoint: its tensors under Hugging Face names, dequantised on load.

One table serves both directions: ARCHITECTURES says which llama.cpp architecture a family is written as
(`smoe export` reads it too), and gguf's own tensor-name map (what llama.cpp's convert_hf_to_gguf.py uses)
names each tensor. Reading inverts it: the GGUF's architecture gives the family, its metadata the config
(HYPERPARAMETERS), and each llama.cpp tensor name the Hugging Face one. Routed experts, stacked [E, out, in]
in one GGUF tensor per role, are presented per expert under the family's release names, each read alone.

Tensor bytes are read with positioned reads at the offsets in the header, as Checkpoint reads
safetensors, and dequantised by gguf.quants, which knows every GGUF type. A Q4_1 expert written by
`smoe export` holds SMOE groups as pairs of blocks (see smoe/export/gguf.py): smoe_codes() gives those
codes back as they are, so re-quantising the file at its own depth changes nothing.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.safetensors_io import pread_exact
from smoe.source.families import FAMILIES

MAGIC = b"GGUF"
SUFFIX = ".gguf"
CHAT_TEMPLATE = "chat_template.jinja"


@dataclass(frozen=True)
class Architecture:
    """How one family maps onto a llama.cpp architecture."""

    arch: str  # name of gguf.MODEL_ARCH member
    permute_qk: bool  # llama.cpp's "llama" graph ropes adjacent pairs, HF rotates halves: reorder q/k rows
    expert_width_key: bool  # expert width in `expert_feed_forward_length` (else `feed_forward_length`)
    experts_key: str  # the config key of the expert count, as the family's released configs spell it
    implied: tuple[tuple[str, object], ...] = ()  # config values llama.cpp's graph for the architecture assumes
    readable: bool = True  # smoe reads this architecture's GGUFs back (else it only writes them)


ARCHITECTURES = {
    "qwen3_moe": Architecture("QWEN3MOE", permute_qk=False, expert_width_key=True, experts_key="num_experts",
                              implied=(("norm_topk_prob", True),)),
    "mixtral": Architecture("LLAMA", permute_qk=True, expert_width_key=False, experts_key="num_local_experts"),
    # DeepSeek's MLA as llama.cpp's deepseek2 (kv_b split in two, see smoe.export.gguf_mla): written, not read back
    "deepseek_v3": Architecture("DEEPSEEK2", permute_qk=False, expert_width_key=True, experts_key="n_routed_experts",
                                readable=False),
    "deepseek_v2": Architecture("DEEPSEEK2", permute_qk=False, expert_width_key=True, experts_key="n_routed_experts",
                                readable=False),
}
EXPERT_TENSORS = {"gate": gguf.MODEL_TENSOR.FFN_GATE_EXP, "up": gguf.MODEL_TENSOR.FFN_UP_EXP,
                  "down": gguf.MODEL_TENSOR.FFN_DOWN_EXP}
ROPE_PERMUTED = (gguf.MODEL_TENSOR.ATTN_Q, gguf.MODEL_TENSOR.ATTN_K)

# `{arch}.KEY` metadata -> config key, as `smoe export` and llama.cpp's converter write them
HYPERPARAMETERS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "expert_used_count": "num_experts_per_tok",
}
REQUIRED = ("block_count", "embedding_length", "attention.head_count", "expert_count", "expert_used_count")
# metadata llama.cpp honours that the config above cannot say: refused rather than dropped
NOT_READ = ("rope.scaling.type", "attention.sliding_window")
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
PLAIN_FORMATS = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}


def permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's q/k rows (each head: first half, second half) -> llama.cpp's pairs (llama.cpp's `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of permute_rope: llama.cpp's adjacent pairs back to HF's halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_name_map(arch: Architecture, layers: int):
    """gguf's Hugging Face -> llama.cpp tensor-name map for the architecture."""
    return gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.arch), layers)


def expert_tensor_name(role: str, layer: int) -> str:
    return gguf.TENSOR_NAMES[EXPERT_TENSORS[role]].format(bid=layer) + ".weight"


def is_gguf(path) -> bool:
    """A file named *.gguf or one that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == SUFFIX:
        return True
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


@dataclass(frozen=True)
class _Stored:
    """Where a logical tensor lives in the GGUF: a tensor, optionally one expert of it, q/k rows reordered."""

    tensor: object  # gguf ReaderTensor
    expert: int | None = None
    rope_heads: int | None = None  # heads to un-permute the rows by (llama.cpp's "llama" q/k)


class GgufCheckpoint:
    """The Checkpoint interface over one GGUF file.

    Trunk tensors keep their llama.cpp names (enough to count and size them) until name_trunk() gives the
    names the model's checkpoints use (smoe.hf.gguf, from transformers' model). `dir` is a directory the
    file stands for: config.json (from the metadata) and the chat template, where smoe.hf.gguf adds the
    tokenizer files; it is removed on close (or when the object goes)."""

    def __init__(self, path):
        self.path = Path(path)
        self.reader = read_gguf(self.path)
        self.gguf_arch = str(field(self.reader, "general.architecture", self.path))
        self.family, self.arch = family_of(self.gguf_arch, self.path)
        self.config = read_config(self.reader, self.gguf_arch, self.family, self.arch, self.path)
        self.has_weights = True
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._logical = self._name_tensors(None)
        self._fd: int | None = None
        self._notified = False
        self.dir = Path(tempfile.mkdtemp(prefix="smoe-gguf-"))
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.write_model_files()

    @property
    def location(self) -> Path:
        return self.path

    # ----- names -----------------------------------------------------------------------------------

    def name_trunk(self, trunk_names: dict[str, str]) -> None:
        """Name the trunk tensors by `trunk_names` (llama.cpp name -> Hugging Face name)."""
        self._logical = self._name_tensors(trunk_names)

    def gguf_names(self) -> list[str]:
        return list(self._tensors)

    def _name_tensors(self, trunk_names: dict[str, str] | None) -> dict[str, _Stored]:
        layers = self.config["num_hidden_layers"]
        experts = self.config[self.arch.experts_key]
        logical: dict[str, _Stored] = {}
        claimed = set()
        for layer in range(layers):
            for role in EXPERT_TENSORS:
                name = expert_tensor_name(role, layer)
                t = self._tensors.get(name)
                if t is None:
                    raise SmoeError(f"{self.path}: no tensor {name} (the {role} projections of layer {layer}'s experts)")
                if len(t.shape) != 3 or int(t.shape[2]) != experts:
                    raise SmoeError(f"{self.path}: tensor {name} has shape {shape_of(t)}, not {experts} stacked experts")
                claimed.add(name)
                for e in range(experts):
                    logical[per_expert_name(self.family, layer, e, role)] = _Stored(t, e)
        rope_heads = self._rope_heads()
        for name, t in self._tensors.items():
            if name in claimed:
                continue
            hf = name if trunk_names is None else trunk_names.get(name)
            if hf is None:
                raise SmoeError(f"{self.path}: tensor {name} has no counterpart in the {self.family} model "
                                f"(smoe reads the tensors llama.cpp's {self.gguf_arch} graph uses)")
            logical[hf] = _Stored(t, rope_heads=rope_heads.get(name.split(".")[-2]))
        return logical

    def _rope_heads(self) -> dict[str, int]:
        if not self.arch.permute_qk:
            return {}
        kinds = [gguf.TENSOR_NAMES[k].split(".")[-1] for k in ROPE_PERMUTED]
        heads = self.config["num_attention_heads"], self.config["num_key_value_heads"]
        return dict(zip(kinds, heads))

    def names(self) -> list[str]:
        return sorted(self._logical)

    def _get(self, name: str) -> _Stored:
        try:
            return self._logical[name]
        except KeyError:
            raise SmoeError(f"{self.path}: no tensor named {name!r}") from None

    def tokenizer_model(self) -> str | None:
        """llama.cpp's name of the tokenizer kind: gpt2 (byte-level BPE), llama (SentencePiece), ..."""
        return optional_field(self.reader, "tokenizer.ggml.model")

    def gguf_type(self, name: str) -> str:
        return self._get(name).tensor.tensor_type.name

    # ----- queries ---------------------------------------------------------------------------------

    def source_format(self, name: str) -> str:
        kind = self.gguf_type(name)
        return PLAIN_FORMATS.get(kind, f"gguf_{kind.lower()}")

    def shape(self, name: str) -> tuple[int, ...]:
        stored = self._get(name)
        full = shape_of(stored.tensor)
        return full[1:] if stored.expert is not None else full

    def dtype(self, name: str) -> torch.dtype:
        """As stored for F32 / F16 / BF16; bf16 for the quantised types, as for Checkpoint's quantised sources."""
        return FLOAT_TYPES.get(self.gguf_type(name), torch.bfloat16)

    def stored_nbytes(self, name: str) -> int:
        stored = self._get(name)
        n = int(stored.tensor.n_bytes)
        return n // int(stored.tensor.shape[-1]) if stored.expert is not None else n

    def total_nbytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.reader.tensors)

    def weight_files(self) -> list[Path]:
        return [self.path]

    def weight_headers(self) -> list[tuple[str, bytes]]:
        """(file name, its header: metadata and tensor table, up to the tensor data)."""
        return [(self.path.name, bytes(self._pread(0, int(self.reader.data_offset))))]

    def inside(self, relative: str, what: str = "file") -> Path:
        return self.dir / relative

    def check_real_valued(self, name: str, what: str = "tensor") -> None:
        kind = self.gguf_type(name)
        if kind.startswith("I"):
            raise SmoeError(f"{self.path}: {what} {name} is stored as {kind}: integers, not weights")

    # ----- loading ---------------------------------------------------------------------------------

    def load(self, name: str, index: int | None = None, digest=None) -> torch.Tensor:
        """The logical tensor dequantised (see dtype()); index=i: only its dim-0 slice [i]."""
        stored = self._get(name)
        if stored.rope_heads is not None:  # rows are reordered: read the whole (trunk-sized) matrix
            w = unpermute_rope(self._read(stored.tensor, None, digest), stored.rope_heads)
            return w if index is None else w[index].clone()
        if stored.expert is None:
            return self._read(stored.tensor, index, digest)
        if index is None:
            return self._read(stored.tensor, stored.expert, digest)
        return self._read(stored.tensor, stored.expert, digest)[index].clone()

    def _read(self, t, index: int | None, digest) -> torch.Tensor:
        shape = shape_of(t)
        nbytes, start = int(t.n_bytes), int(t.data_offset)
        if index is not None:
            if not 0 <= index < shape[0]:
                raise IndexError(f"{t.name}: index {index} out of range for shape {shape}")
            nbytes //= shape[0]
            start += index * nbytes
            shape = shape[1:]
        raw = self._pread(start, nbytes)
        if digest is not None:
            digest.update(raw)
        return dequantise(raw, t.tensor_type, shape, t.name, self.path)

    def _pread(self, start: int, nbytes: int) -> bytearray:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            self._close_fd = weakref.finalize(self, os.close, self._fd)
        return pread_exact(self._fd, start, nbytes, self.path)

    def smoe_codes(self, name: str, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(packed codes, fp16 scales) when the expert projection is SMOE groups at `bits` held as Q4_1 block
        pairs (as `smoe export` writes them), else None; re-encoding a quantised type says, once, that the
        errors compound."""
        stored = self._get(name)
        kind = stored.tensor.tensor_type
        if kind == gguf.GGMLQuantizationType.Q4_1 and stored.expert is not None:
            raw = np.frombuffer(self._pread(*expert_span(stored)), dtype=np.uint8)
            found = q4_1_smoe_codes(raw, self.shape(name), bits)
            if found is not None:
                return found
        if kind.name not in FLOAT_TYPES and not self._notified:
            self._notified = True
            print(f"smoe: notice: {self.path.name}: its experts are {kind.name}-quantised; quantizing them again "
                  f"compounds the two rounding errors (quantize the original bf16 checkpoint when you have it)",
                  file=sys.stderr)
        return None

    # ----- files -----------------------------------------------------------------------------------

    def write_model_files(self) -> None:
        """config.json and the chat template, where a Hugging Face model directory keeps them."""
        import json

        (self.dir / "config.json").write_text(json.dumps(self.config, indent=1))
        template = optional_field(self.reader, "tokenizer.chat_template")
        if template:
            (self.dir / CHAT_TEMPLATE).write_text(str(template))

    def close(self) -> None:
        if self._fd is not None:
            self._close_fd()
            self._fd = None
        self._remove_dir()

    def __enter__(self) -> GgufCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----- the file ------------------------------------------------------------------------------------


def read_gguf(path: Path):
    """gguf's reader over the file (header, metadata, tensor table); a damaged file is one line naming it."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise SmoeError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF with {MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader's own errors (struct, numpy reshape, enum) all mean a damaged header
        raise SmoeError(f"{path}: truncated or corrupt GGUF ({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise SmoeError(f"{path}: truncated GGUF: tensor {t.name} ends at byte {int(t.data_offset) + int(t.n_bytes):,}, "
                            f"the file has {size:,}")
    return reader


def field(reader, key: str, path: Path):
    value = optional_field(reader, key)
    if value is None:
        raise SmoeError(f"{path}: GGUF metadata has no {key}")
    return value


def optional_field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def shape_of(t) -> tuple[int, ...]:
    """The tensor's shape in PyTorch order (GGUF lists dimensions innermost first)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def expert_span(stored: _Stored) -> tuple[int, int]:
    per_expert = int(stored.tensor.n_bytes) // int(stored.tensor.shape[-1])
    return int(stored.tensor.data_offset) + stored.expert * per_expert, per_expert


def dequantise(raw: bytearray, kind, shape: tuple[int, ...], name: str, path: Path) -> torch.Tensor:
    data = np.frombuffer(raw, dtype=np.uint8)
    if kind.name in FLOAT_TYPES:
        dtype = FLOAT_TYPES[kind.name]
        return torch.frombuffer(raw, dtype=dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)
    try:
        values = gguf.quants.dequantize(data.reshape(*shape[:-1], -1), kind)
    except (NotImplementedError, ValueError) as e:
        raise SmoeError(f"{path}: tensor {name}: cannot dequantise {kind.name} ({e})") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape).to(torch.bfloat16)


# ----- architecture, config, names -----------------------------------------------------------------


def family_of(gguf_arch: str, path: Path) -> tuple[str, Architecture]:
    """The family the export writes as this llama.cpp architecture (each architecture holds one family)."""
    readable = {family: arch for family, arch in ARCHITECTURES.items() if arch.readable}
    for family, arch in readable.items():
        if gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch.arch)] == gguf_arch:
            return family, arch
    known = ", ".join(f"{gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, a.arch)]} ({f})" for f, a in readable.items())
    raise SmoeError(f"{path}: GGUF architecture {gguf_arch!r} is not one smoe reads (it reads {known})")


def read_config(reader, gguf_arch: str, family: str, arch: Architecture, path: Path) -> dict:
    """The model's config.json from the GGUF's metadata: llama.cpp's hyperparameters under the family's keys."""
    get = lambda key: optional_field(reader, f"{gguf_arch}.{key}")
    missing = [key for key in REQUIRED if get(key) is None]
    if missing:
        raise SmoeError(f"{path}: GGUF metadata has no {gguf_arch}.{missing[0]}"
                        + (" (a dense model, not a mixture of experts)" if missing[0] == "expert_count" else ""))
    for key in NOT_READ:
        value = get(key)
        if value not in (None, "none", 0):
            raise SmoeError(f"{path}: {gguf_arch}.{key} is {value!r}; smoe does not read it from a GGUF")
    config = {"model_type": family, **{k: plain(get(key)) for key, k in HYPERPARAMETERS.items() if get(key) is not None}}
    config[arch.experts_key] = int(get("expert_count"))
    if arch.expert_width_key:
        config["moe_intermediate_size"] = int(field(reader, f"{gguf_arch}.expert_feed_forward_length", path))
    config["intermediate_size"] = int(field(reader, f"{gguf_arch}.feed_forward_length", path))
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": plain(get("rope.freq_base") or 10000.0)}
    config.setdefault("vocab_size", len(field(reader, "tokenizer.ggml.tokens", path)))
    config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in reader.tensors)
    for key in ("bos_token_id", "eos_token_id"):
        value = optional_field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    return config | dict(arch.implied)


def plain(value):
    """A metadata number as JSON writes it: float32 values by their shortest float32 spelling (1e-06, not
    9.99999997e-07)."""
    if isinstance(value, float):
        return float(str(np.float32(value)))
    return int(value) if isinstance(value, (int, np.integer)) else value


def per_expert_name(family: str, layer: int, expert: int, role: str) -> str:
    """The family's release name of one expert's projection (its per-expert layout)."""
    fam = next(f for f in FAMILIES if f.name == family)
    layout = next(lay for lay in fam.layouts if "{e}" in lay.roles[role].template)
    return f"model.layers.{layer}." + layout.roles[role].template.format(e=expert)


# ----- SMOE groups in Q4_1 -------------------------------------------------------------------------


def q4_1_smoe_codes(raw: np.ndarray, shape: tuple[int, int], bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q4_1 blocks (d, m, 16 bytes) [out·in/32, 20] -> SMOE (packed codes, scales) at `bits` when every pair of
    blocks is one SMOE group: the same m = −s and d = fp16(s/h), codes within 0..2h; else None."""
    out, inp = shape
    if (out * inp) % codec.GROUP_SIZE:
        return None  # the last group is padded, and the padding's codes are not in the file
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).reshape(-1, 2)
    m = blocks[:, 2:4].copy().view(np.float16).reshape(-1, 2)
    nibbles = blocks[:, 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).reshape(-1, codec.GROUP_SIZE)
    if not (np.array_equal(d[:, 0], d[:, 1]) and np.array_equal(m[:, 0], m[:, 1])):
        return None
    s = (-m[:, 0]).astype(np.float16)
    h = codec.half_range(bits)
    if np.any(s < 0) or not np.array_equal(d[:, 0], (s.astype(np.float64) / h).astype(np.float16)) or q.max() > 2 * h:
        return None
    packed = codec.pack_codes(torch.from_numpy(q.copy()), bits)
    return packed, torch.from_numpy(s.copy())
