"""The sculptor: a Hugging Face MoE checkpoint in, a vault out, tensor by tensor in bounded memory.

The vault is built in `<out>.partial-<fingerprint>` and renamed into place only when complete, so
an interrupted run leaves nothing under the target name; a re-run with the same inputs resumes from
the blobs already written and verified.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from smoe.convert import calibrate, encoders
from smoe.convert.gptq import encode_gptq_batch
from smoe.devices import resolve_device
from smoe.errors import SmoeError
from smoe.format import codec
from smoe.format.jsonfile import parse_json
from smoe.format.output import Output, resumable_tag, writing
from smoe.format.safetensors_io import WRITABLE, write_safetensors
from smoe.format.vault import COPIED_FILES, DEFAULT_ALIGNMENT, TRUNK_FILE, QuantisedTensor, VaultWriter, align
from smoe.hf.gguf import open_source
from smoe.hf.model import check_buildable
from smoe.progress import bar as progress_bar
from smoe.source.checkpoint import SAFETENSORS_INDEX, Checkpoint
from smoe.source.layouts import ExpertMap
from smoe.source.loading import load_bias, load_projection
from smoe.source.matching import map_experts
from smoe.version import __version__

ENCODER = "grid"  # the 64-candidate fp16 scale search of smoe.format.codec


@dataclass
class SculptReport:
    family: str
    experts: int
    expert_bytes_in: int
    trunk_bytes: int
    expert_bytes_out: int
    vault_bytes: int
    seconds: float
    snr_db: dict[str, float] = field(default_factory=dict)  # role -> mean SNR over experts
    weighted_snr_db: dict[str, float] = field(default_factory=dict)  # role -> mean input-weighted SNR (calibrated)
    bits: int = 4
    resumed_experts: int = 0
    weights_by_bits: dict[int, int] = field(default_factory=dict)  # expert weights stored at each depth

    @property
    def depth(self) -> str:
        return codec.depth_name(self.weights_by_bits or {self.bits: 1})

    @property
    def expert_share(self) -> float:
        total = self.expert_bytes_in + self.trunk_bytes
        return self.expert_bytes_in / total if total else 0.0


def source_fingerprint(ckpt: Checkpoint, bits: int, encoder: str, alignment: int, extra: str = "") -> str:
    """Hash of what determines the output's layout: config, index and the headers of the weight files
    read, bits, encoder (and `extra`: the calibration file's hash and the plan, when there are). No
    tensor data is read here: each journalled blob carries the digest of its own sources."""
    h = hashlib.sha256(f"smoe-vault-2|{bits}|{encoder}|{alignment}{extra}".encode())
    for name in ("config.json", SAFETENSORS_INDEX):
        if (ckpt.dir / name).is_file():
            h.update(name.encode() + ckpt.inside(name).read_bytes())
    for name, header in ckpt.weight_headers():
        h.update(name.encode() + header)
    return resumable_tag(h.hexdigest())


def sculpt(model_dir: str | Path, out_dir: str | Path, force: bool = False, reads=(), **options) -> SculptReport:
    """Write the vault of `model_dir` at `out_dir` (options: those of `write_vault`), one writer at a time;
    `reads`: other files the command read (a plan), which --force must not remove either."""
    with writing(out_dir, "quantize", [model_dir, options.get("calib"), *reads], force) as output:
        return write_vault(model_dir, output, **options)


def write_vault(
    model_dir: str | Path,
    output: Output,
    bits: int = 4,
    device: str = "auto",
    num_experts: int | None = None,
    progress: bool = True,
    alignment: int = DEFAULT_ALIGNMENT,
    encoder: str | None = None,
    calib: str | Path | None = None,
    plan: dict | None = None,
    calib_tokens: int | None = None,
    stats=None,
    encode_all=None,
) -> SculptReport:
    """`encoder` "grid" or a calibrated one from smoe.convert.encoders, which needs `calib` (a text file;
    `stats` may pass its CalibrationStats already collected); `plan` maps (layer, role) -> bits per
    tensor, or a tuple of bits per expert (gate and up equal), overriding `bits`. No encoder: gptq with `calib`, grid
    without. `encode_all`: how the experts are encoded (write_experts; default here, in this process)."""
    start = time.perf_counter()
    encoder = encoder or encoders.default_encoder(calib)
    codec.check_bits(bits)
    encoders.check_encoder(encoder)
    if encoder in encoders.NEEDS_CALIBRATION and calib is None:
        raise SmoeError(f"the {encoder} encoder needs calibration text (--calib FILE)")
    depths = plan
    check_plan_bits(depths)
    if depths:
        bits = majority_depth(depths)
    dev = resolve_device(device)
    ckpt = open_source(model_dir, calibrated=encoder in encoders.NEEDS_CALIBRATION)
    if not ckpt.has_weights:
        raise SmoeError(f"{ckpt.dir}: no safetensors weights found (only an index or a config)")
    if not (ckpt.dir / "config.json").exists():
        raise SmoeError(f"{ckpt.dir}: no config.json")
    expert_map = map_experts(ckpt.config, ckpt.names(), num_experts=num_experts)
    check_sources(ckpt, expert_map)
    check_buildable(ckpt.config, {n: tuple(ckpt.shape(n)) for n in trunk_names(ckpt, expert_map)}, str(ckpt.dir / "config.json"))
    check_plan_matches(depths, expert_map)
    calib_tokens = calib_tokens or calibrate.DEFAULT_TOKENS
    calib_id = f"|{calibrate.file_hash(calib)}|{calib_tokens}" if calib is not None and encoder != "grid" else ""
    plan_id = f"|{sorted(depths.items())}" if depths else ""
    fingerprint = source_fingerprint(ckpt, bits, encoder, alignment, calib_id + plan_id)
    check_disk_space(ckpt, expert_map, max(max(expert_depths(b)) for b in depths.values()) if depths else bits,
                     output.partial_path(fingerprint))
    partial = output.begin(tag=fingerprint, keep=holds_blobs)
    if encoder in encoders.NEEDS_CALIBRATION and stats is None:
        stats = calibrate.StreamedStats(ckpt.dir, calib, calib_tokens, progress=progress, device=dev)

    writer = VaultWriter(partial, bits, alignment)
    try:
        coder = Coder(encoder, stats, depths or {}, bits)
        resumed = keep_unchanged_blobs(ckpt, expert_map, writer, coder, progress)
        snr, weighted_snr, expert_out = write_experts(ckpt, expert_map, writer, coder, dev, progress,
                                                      encode_all or default_encoding(encoder, dev))
        trunk_bytes = write_trunk_file(ckpt, expert_map, partial / TRUNK_FILE, progress)
        for name in COPIED_FILES:
            if (ckpt.dir / name).exists():
                shutil.copyfile(ckpt.inside(name), partial / name)
        writer.finish(vault_meta(ckpt, expert_map, partial) | {"encoder": encoder})
    finally:
        if not writer.data.closed:
            writer.close()
    output.publish()
    return SculptReport(
        family=expert_map.family, experts=len(expert_map.experts), expert_bytes_in=expert_source_bytes(ckpt, expert_map),
        trunk_bytes=trunk_bytes, expert_bytes_out=expert_out, vault_bytes=dir_size(output.path),
        seconds=time.perf_counter() - start, snr_db=snr, weighted_snr_db=weighted_snr, bits=bits, resumed_experts=resumed,
        weights_by_bits=weights_by_bits(expert_map, depths, bits),
    )


def default_encoding(encoder: str, dev: torch.device):
    """In this process: GPTQ on a GPU a layer's experts at a time, everything else one expert at a time."""
    return encode_batched if encoder == "gptq" and dev.type == "cuda" else encode_here


def weights_by_bits(expert_map: ExpertMap, depths: dict | None, bits: int) -> dict[int, int]:
    """Expert weights per depth; every (layer, role) tensor has the same shape in each of its experts."""
    shapes = expert_map.expert_shapes()
    counts: dict[int, int] = {}
    for layer in expert_map.moe_layers:
        for role, (o, i) in shapes.items():
            b = (depths or {}).get((layer, role), bits)
            for d in expert_depths(b, expert_map.num_experts):
                counts[d] = counts.get(d, 0) + o * i
    return counts


def expert_depths(bits: int | tuple[int, ...], experts: int = 1) -> tuple[int, ...]:
    """A plan's depth of one (layer, role) as one per expert: a tensor's one depth, or its tuple."""
    return bits if isinstance(bits, tuple) else (bits,) * experts


def holds_blobs(partial: Path) -> bool:
    """Whether a partial vault left by a failure has a journalled blob to resume from (else it goes)."""
    journal = partial / VaultWriter.JOURNAL
    return journal.is_file() and journal.stat().st_size > 0


def check_disk_space(ckpt: Checkpoint, expert_map: ExpertMap, bits: int, partial: Path) -> None:
    """Refuse before writing anything; blobs already in a resumable partial count as written."""
    need = expected_vault_bytes(ckpt, expert_map, bits)
    parent = partial.parent
    if not parent.exists():
        raise SmoeError(f"{parent}: output directory's parent does not exist")
    free = shutil.disk_usage(parent).free + (dir_size(partial) if partial.exists() else 0)
    if free < need:
        raise SmoeError(f"not enough disk space at {partial.parent}: need {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free")


def expected_vault_bytes(ckpt: Checkpoint, expert_map: ExpertMap, bits: int) -> int:
    trunk = sum(nbytes_of(ckpt, n) for n in trunk_names(ckpt, expert_map))
    per_expert = sum(sum(codec.encoded_nbytes(o * i, bits)) + 128 for o, i in expert_map.expert_shapes().values())
    return trunk + len(expert_map.experts) * align(per_expert, 4096) + (1 << 20)


def nbytes_of(ckpt: Checkpoint, name: str) -> int:
    n = torch.empty(0, dtype=ckpt.dtype(name)).element_size()
    for s in ckpt.shape(name):
        n *= s
    return n


def trunk_names(ckpt: Checkpoint, expert_map: ExpertMap) -> list[str]:
    return [n for n in ckpt.names() if n not in expert_map.expert_names]


def expert_source_bytes(ckpt: Checkpoint, expert_map: ExpertMap) -> int:
    return sum(ckpt.stored_nbytes(n) or 0 for n in expert_map.expert_names)


@dataclass
class Coder:
    """How each projection is encoded: the encoder, its calibration statistics and the depth per tensor."""

    encoder: str
    stats: object
    depths: dict[tuple[int, str], int | tuple[int, ...]]
    bits: int

    def moment(self, layer: int, expert: int, role: str, digest=None) -> torch.Tensor | None:
        """The second moment the encoder weighs `role`'s error by (None without statistics); fed to
        `digest` too: a calibrated blob depends on it as much as on the weights."""
        if self.stats is None:
            return None
        moment = self.stats.second_moment(layer, expert, role).contiguous()
        if digest is not None:
            digest.update(moment.numpy())
        return moment

    def depth(self, layer: int, role: str, expert: int) -> int:
        bits = self.depths.get((layer, role), self.bits)
        return bits if isinstance(bits, int) else bits[expert]

    def encode(self, w: torch.Tensor, moment: torch.Tensor | None, layer: int, role: str, name: str, expert: int):
        bits = self.depth(layer, role, expert)
        moment = moment.to(w.device) if moment is not None else None
        codes, scales = encoders.encode(w, bits, self.encoder, moment, name=name)
        return bits, codes, scales


def stored_or_encoded(ckpt, coder: Coder, src, w: torch.Tensor, moment, key: tuple[int, int], name: str):
    """(bits, codes, scales): the source's own SMOE codes where it holds the projection as SMOE groups at the
    depth wanted (a GGUF `smoe export` wrote) and the encoder is the plain grid search, else `w` encoded."""
    bits = coder.depth(key[0], src.role, key[1])
    if coder.encoder == ENCODER and src.expert_index is None:
        stored = ckpt.smoe_codes(src.name, bits)
        if stored is not None:
            return bits, *stored
    return coder.encode(w, moment, key[0], src.role, name, key[1])


def check_plan_bits(depths: dict | None) -> None:
    for (layer, role), b in (depths or {}).items():
        for d in expert_depths(b):
            codec.check_bits(d)
        if role == "up" and (layer, "gate") in depths and depths[(layer, "gate")] != b:
            raise SmoeError(f"the plan gives layer {layer} gate and up different depths; one fused kernel serves both")


def check_plan_matches(depths: dict | None, expert_map: ExpertMap) -> None:
    known = {(layer, role) for layer in expert_map.moe_layers for role in expert_map.roles}
    if depths and set(depths) != known:
        odd = sorted(set(depths) ^ known)[:4]
        raise SmoeError(f"the plan does not match the model: tensors {odd} are missing from it or unknown to the model")
    for (layer, role), b in (depths or {}).items():
        if isinstance(b, tuple) and len(b) != expert_map.num_experts:
            raise SmoeError(f"the plan gives layer {layer} {role} {len(b)} depths; the model has {expert_map.num_experts} "
                            "experts")


def majority_depth(depths: dict[tuple[int, str], int]) -> int:
    """The header's default depth for a mixed vault: the one most tensors have (ties: the deeper)."""
    values = [d for b in depths.values() for d in expert_depths(b)]
    return max(set(values), key=lambda b: (values.count(b), b))


@dataclass
class EncodedExpert:
    """One expert's blob contents as encoded, and the SNRs the summary reports (dB per role)."""

    key: tuple[int, int]
    tensors: list[QuantisedTensor]
    biases: dict[str, torch.Tensor]
    source: str  # the digest of everything it was encoded from (the journal's resume check)
    snr: dict[str, float]
    weighted_snr: dict[str, float]
    numel: int


def encode_expert(ckpt, expert_map: ExpertMap, coder: Coder, dev: torch.device, key: tuple[int, int]) -> EncodedExpert:
    """Read and encode one expert's projections (one at a time) and its biases."""
    expected = expert_map.expert_shapes()
    tensors, digest, snr, weighted, numel = [], xxhash.xxh3_64(), {}, {}, 0
    for src, w, moment in expert_inputs(ckpt, expert_map, coder, key, digest):
        name = source_name(src)
        check_shape(name, src.role, tuple(w.shape), expected)
        w = w.to(dev)
        bits, codes, scales = stored_or_encoded(ckpt, coder, src, w, moment, key, name)
        q = QuantisedTensor(src.role, tuple(w.shape), bits, codes.cpu(), scales.cpu())
        decoded = q.decode().to(dev)
        snr[src.role] = codec.snr_db(w, decoded)
        if moment is not None:
            weighted[src.role] = codec.weighted_snr_db(w, decoded, moment)
        tensors.append(q)
        numel += w.numel()
    biases = check_finite_all(expert_biases(ckpt, expert_map, key, digest))
    return EncodedExpert(key, tensors, biases, digest.hexdigest(), snr, weighted, numel)


def encode_here(ckpt, expert_map: ExpertMap, coder: Coder, dev: torch.device, todo: list):
    """The experts of `todo`, encoded in this process one after another (in order)."""
    return (encode_expert(ckpt, expert_map, coder, dev, key) for key in todo)


# Experts GPTQ-encodes together on a GPU (smoe.convert.gptq): their weights, Hessians and fp64 inverse factors are
# held at once (32 experts of 1536 x 4096 peaked at 20 GiB of GPU memory; scripts/gpu_gptq_bench.py).
BATCH_EXPERTS = 32


def encode_batched(ckpt, expert_map: ExpertMap, coder: Coder, dev: torch.device, todo: list,
                   chunk: int = BATCH_EXPERTS):
    """The EncodedExperts encode_here yields for `todo`, in its order, from the same reads (each expert's digest fed
    the same bytes in the same order, the same checks), but each projection of up to `chunk` experts of one layer
    GPTQ-encoded in one batch: on a GPU its column sweep is then one loop for all of them. Encoders other than gptq
    go expert by expert."""
    if coder.encoder != "gptq":
        yield from (encode_expert(ckpt, expert_map, coder, dev, key) for key in todo)
        return
    for keys in layer_chunks(todo, chunk):
        yield from encode_chunk(ckpt, expert_map, coder, dev, keys)


def layer_chunks(todo: list, size: int):
    """Runs of at most `size` consecutive keys of one layer."""
    run: list = []
    for key in todo:
        if run and (key[0] != run[0][0] or len(run) == size):
            yield run
            run = []
        run.append(key)
    if run:
        yield run


def encode_chunk(ckpt, expert_map: ExpertMap, coder: Coder, dev: torch.device, keys: list) -> list[EncodedExpert]:
    """The experts of `keys` (one layer), a projection of each at a time (one role of the chunk in memory), each
    expert's read in its own order into its own digest, as encode_expert reads them; experts whose projections
    differ in roles (no layout seen so far) are encoded one by one."""
    if len({tuple(src.role for src in expert_map.experts[key]) for key in keys}) > 1:
        return [encode_expert(ckpt, expert_map, coder, dev, key) for key in keys]
    digests = [xxhash.xxh3_64() for _ in keys]
    readers = [expert_inputs(ckpt, expert_map, coder, key, d) for key, d in zip(keys, digests)]
    done = [Encoded() for _ in keys]
    for inputs in zip(*readers):
        for result, (src, w, moment), (bits, codes, scales) in zip(
                done, inputs, encode_projection(ckpt, expert_map, coder, dev, keys, inputs)):
            result.add(src.role, w.to(dev), moment, QuantisedTensor(src.role, tuple(w.shape), bits, codes, scales))
    return [result.expert(key, check_finite_all(expert_biases(ckpt, expert_map, key, d)), d.hexdigest())
            for result, key, d in zip(done, keys, digests)]


def encode_projection(ckpt, expert_map: ExpertMap, coder: Coder, dev: torch.device, keys: list, inputs: list):
    """[(bits, codes, scales) on the CPU] for one projection (source, weights, second moment) of each expert of
    `keys` (one layer); the experts a plan gives one depth are encoded in one batch."""
    expected = expert_map.expert_shapes()
    names = [source_name(src) for src, _, _ in inputs]
    for (src, w, _), name in zip(inputs, names):
        check_shape(name, src.role, tuple(w.shape), expected)
    if not batchable(inputs):  # what encode_expert would do, with its errors (no statistics, say)
        return [cpu(stored_or_encoded(ckpt, coder, src, w.to(dev), moment, key, name))
                for key, (src, w, moment), name in zip(keys, inputs, names)]
    depths = [coder.depth(layer, inputs[0][0].role, expert) for layer, expert in keys]
    out: list = [None] * len(inputs)
    for bits in sorted(set(depths)):
        at = [i for i, d in enumerate(depths) if d == bits]
        ws = torch.stack([inputs[i][1].to(dev) for i in at])
        hessians = torch.stack([inputs[i][2].to(dev, torch.float32) for i in at])
        codes, scales = encode_gptq_batch(ws, hessians, bits, [names[i] for i in at])
        for j, i in enumerate(at):
            out[i] = (bits, codes[j].to("cpu", copy=True), scales[j].to("cpu", copy=True))
    return out


def batchable(inputs: list) -> bool:
    """One role and shape for all, each with a full [in, in] second moment."""
    src0, w0, _ = inputs[0]
    return all(src.role == src0.role and w.shape == w0.shape and w.dim() == 2 and moment is not None
               and moment.shape == (w.shape[1], w.shape[1]) for src, w, moment in inputs)


def source_name(src) -> str:
    return f"{src.name}" + (f"[{src.expert_index}]" if src.expert_index is not None else "")


def cpu(encoded: tuple) -> tuple:
    bits, codes, scales = encoded
    return bits, codes.cpu(), scales.cpu()


class Encoded:
    """One expert's projections as encoded so far, with the SNRs encode_expert reports."""

    def __init__(self):
        self.tensors: list[QuantisedTensor] = []
        self.snr: dict[str, float] = {}
        self.weighted: dict[str, float] = {}
        self.numel = 0

    def add(self, role: str, w: torch.Tensor, moment, q: QuantisedTensor) -> None:
        decoded = q.decode().to(w.device)
        self.snr[role] = codec.snr_db(w, decoded)
        if moment is not None:
            self.weighted[role] = codec.weighted_snr_db(w, decoded, moment)
        self.tensors.append(q)
        self.numel += w.numel()

    def expert(self, key, biases: dict, source: str) -> EncodedExpert:
        return EncodedExpert(key, self.tensors, biases, source, self.snr, self.weighted, self.numel)


def write_experts(ckpt, expert_map: ExpertMap, writer: VaultWriter, coder: Coder, dev: torch.device, progress: bool,
                  encode_all=encode_here):
    """Encode every (layer, expert) not already in the partial vault, through `encode_all` (encode_here, or a
    fan-out over workers yielding the same EncodedExperts in the same order); returns (mean SNR per role, mean
    input-weighted SNR per role where there is calibration, bytes out)."""
    done = writer.done()
    todo = [key for key in sorted(expert_map.experts) if key not in done]
    expected = expert_map.expert_shapes()
    snr_sum: dict[str, float] = {}
    weighted_sum: dict[str, float] = {}
    weights = sum(o * i for o, i in expected.values()) or None
    bar = progress_bar(total=weights and 2 * weights * len(expert_map.experts), initial=weights and 2 * weights * len(done),
                       enabled=progress, unit="B", unit_scale=True, desc=f"experts ({len(expert_map.experts)})")
    for encoded in encode_all(ckpt, expert_map, coder, dev, todo):
        for sums, values in ((snr_sum, encoded.snr), (weighted_sum, encoded.weighted_snr)):
            for role, db in values.items():
                sums[role] = sums.get(role, 0.0) + db
        writer.add(*encoded.key, encoded.tensors, encoded.biases, source=encoded.source)
        bar.update(2 * encoded.numel)
    bar.close()
    snr = {role: total / max(len(todo), 1) for role, total in snr_sum.items()}
    weighted = {role: total / max(len(todo), 1) for role, total in weighted_sum.items()}
    return snr, weighted, sum(e.size for e in writer.entries)


def expert_inputs(ckpt, expert_map: ExpertMap, coder: Coder, key: tuple[int, int], digest):
    """Yield (source, [out, in] weights, second moment or None) per projection of one expert, one at a
    time, feeding `digest` everything its blob is encoded from."""
    for src in expert_map.experts[key]:
        yield src, load_projection(ckpt, src, digest), coder.moment(*key, src.role, digest)


def expert_biases(ckpt, expert_map: ExpertMap, key: tuple[int, int], digest) -> dict[str, torch.Tensor]:
    return {b.role: load_bias(ckpt, b, digest) for b in expert_map.biases.get(key, [])}


def source_digest(ckpt, expert_map: ExpertMap, coder: Coder, key: tuple[int, int]) -> str | None:
    """The digest `write_experts` journals for `key`'s blob, from the source as it is now."""
    if key not in expert_map.experts:
        return None
    digest = xxhash.xxh3_64()
    for _ in expert_inputs(ckpt, expert_map, coder, key, digest):
        pass
    expert_biases(ckpt, expert_map, key, digest)
    return digest.hexdigest()


def keep_unchanged_blobs(ckpt, expert_map: ExpertMap, writer: VaultWriter, coder: Coder, progress: bool) -> int:
    """Keep the resumed blobs whose sources (stored bytes, calibration moments) read as when they were
    encoded; from the first that differs on, the data file is cut and re-encoded. Returns the count kept.

    The fingerprint covers only headers, so a checkpoint rewritten with the same names and shapes (or
    calibration moved by a changed trunk) reaches the same partial: only this re-read tells."""
    entries = list(writer.entries)
    bar = progress_bar(entries, bool(progress and entries), desc="checking resumed blobs", unit="blob")
    for i, entry in enumerate(bar):
        key = (entry.layer, entry.expert)
        journalled = writer.sources.get(key)
        if journalled is None or journalled != source_digest(ckpt, expert_map, coder, key):
            bar.close()
            print(f"smoe: notice: layer {entry.layer} expert {entry.expert} was encoded from other source weights or "
                  f"calibration than the model's now: re-encoding it and the {len(entries) - i - 1} blobs after it "
                  f"({i} kept)", file=sys.stderr)
            writer.keep(i)
            return i
    return len(entries)


def check_sources(ckpt: Checkpoint, expert_map: ExpertMap) -> None:
    """Refuse, before anything is written, a tensor that cannot be read (or kept) as its real values,
    and a file to copy that lies outside the model directory."""
    for name in sorted(expert_map.expert_names):
        ckpt.check_real_valued(name, "expert tensor")
    for name in trunk_names(ckpt, expert_map):
        check_trunk_source(ckpt, name)
    for name in COPIED_FILES:
        if (ckpt.dir / name).exists():
            path = ckpt.inside(name)
            if name.endswith(".json"):  # as the vault's reader will check it: a key given twice is refused
                parse_json(path.read_bytes(), path)


def check_trunk_source(ckpt: Checkpoint, name: str) -> None:
    """A trunk tensor is copied exactly, so integer buffers (position ids) are fine; but a layer's
    `.weight` is never an integer or unscaled fp8 one, and the trunk file holds only some dtypes."""
    if name.endswith(".weight"):
        ckpt.check_real_valued(name, "trunk tensor")
    dtype = ckpt.dtype(name)
    if dtype not in WRITABLE:
        raise SmoeError(f"trunk tensor {name} is stored as {ckpt.source_format(name)}, which the vault's trunk file "
                        f"does not hold (supported: {', '.join(sorted(WRITABLE.values()))})")


def check_shape(name: str, role: str, shape: tuple[int, int], expected: dict[str, tuple[int, int]]) -> None:
    """A projection whose shape disagrees with the config means a misread layout: stop, never write it."""
    if role in expected and shape != expected[role]:
        raise SmoeError(f"tensor {name}: {role} projection has shape {shape}, the config implies {expected[role]}")


def check_finite_all(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name, t in tensors.items():
        check_finite(name, t)
    return tensors


def check_finite(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise SmoeError(f"tensor {name}: NaN or inf values (refusing to write a broken vault)")
    return t


def write_trunk_file(ckpt: Checkpoint, expert_map: ExpertMap, path: Path, progress: bool) -> int:
    names = trunk_names(ckpt, expert_map)
    specs = [(n, ckpt.dtype(n), ckpt.shape(n)) for n in names]
    bar = (lambda xs: progress_bar(xs, unit="tensor", desc="trunk")) if progress else None
    write_safetensors(path, specs, lambda n: check_finite(n, ckpt.load(n)), progress=bar)
    return sum(nbytes_of(ckpt, n) for n in names)


def vault_meta(ckpt: Checkpoint, expert_map: ExpertMap, partial: Path) -> dict:
    return {
        "smoe_version": __version__,
        "family": expert_map.family,
        "model_type": expert_map.model_type,
        "moe_layers": expert_map.moe_layers,
        "num_experts": expert_map.num_experts,
        "top_k": expert_map.top_k,
        "roles": list(expert_map.roles),
        "expert_shapes": {r: list(s) for r, s in expert_map.expert_shapes().items()},
        "encoder": ENCODER,
        "source": {"path": str(ckpt.location), "formats": sorted({ckpt.source_format(n) for n in expert_map.expert_names})},
    }


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
