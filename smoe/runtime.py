"""Run a vault: the transformers model holds the resident trunk; routed experts come from the store.

The model is built on the meta device from the vault's config, so expert parameters are never
allocated; the trunk is loaded into it with transformers' own checkpoint-key renamings. Experts run
through transformers' experts registry (`ExpertsInterface`): every experts module forwards to
`smoe_experts_forward`, which asks the store for the experts the router picked, all at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import transformers
from safetensors.torch import load_file
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.integrations.moe import ExpertsInterface

from smoe import kernels_cpu
from smoe.devices import resolve_device
from smoe.errors import SmoeError
from smoe.families import check_model_config
from smoe.store import ExpertStore, default_cache_bytes
from smoe.vault import Vault

EXPERTS_IMPLEMENTATION = "smoe"
LAYER_RE = re.compile(r"\.(?:layers|blocks|h)\.(\d+)\.")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def smoe_experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """The registered experts implementation: module.smoe_engine computes with the vault's experts."""
    return module.smoe_engine.forward(module, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(EXPERTS_IMPLEMENTATION, smoe_experts_forward)


def is_experts_module(module: torch.nn.Module) -> bool:
    """Modules decorated with transformers' `use_experts_implementation` (and ours) carry these flags."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated"))


class StreamingExperts(torch.nn.Module):
    """Stands in, through `set_submodule`, for an experts module that transformers' registry does not
    reach: same call (hidden_states, top_k_index, top_k_weights), gated SwiGLU-style experts."""

    has_gate, has_bias, is_transposed, is_concatenated = True, False, False, True

    def __init__(self, act_fn, scale_input: bool = False):
        super().__init__()
        self.act_fn = act_fn
        self.smoe_scale_input = scale_input

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = self.smoe_engine.forward(self, flat, top_k_index.reshape(flat.shape[0], -1),
                                       top_k_weights.reshape(flat.shape[0], -1))
        return out.view(hidden_states.shape)


class StreamingLlama4Moe(torch.nn.Module):
    """Llama 4's MoE block with routed experts streamed. Llama 4 computes every expert densely and
    scales each expert's input (not its output) by the sigmoid router score; only the top-k have a
    non-zero score, so running just those experts on scaled inputs gives the same result."""

    def __init__(self, block):
        super().__init__()
        self.router, self.shared_expert, self.top_k = block.router, block.shared_expert, block.top_k
        self.experts = StreamingExperts(block.experts.act_fn, scale_input=True)

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
        router_scores, router_logits = self.router(hidden_states)
        top_k_index = torch.topk(router_logits, self.top_k, dim=-1).indices
        routed = self.experts(hidden_states, top_k_index, router_scores.gather(1, top_k_index))
        return self.shared_expert(hidden_states) + routed, router_logits


def replace_unregistered_moe_blocks(model) -> None:
    """Swap the MoE blocks of families whose experts bypass the registry (by transformers class name)."""
    replacements = {
        "DbrxExperts": lambda m: StreamingExperts(m.mlp.activation_fn),
        "Llama4TextMoe": StreamingLlama4Moe,
    }
    for name, module in list(model.named_modules()):
        make = replacements.get(type(module).__name__)
        if make is not None:
            model.set_submodule(name, make(module))


@dataclass
class ExpertsEngine:
    """Computes one MoE layer's routed experts for the tokens of a call."""

    store: ExpertStore
    roles: tuple[str, ...]
    largest_expert: int = 0  # prepared bytes of the largest expert; measured on first use (it scans the index)

    def forward(self, module, hidden_states, top_k_index, top_k_weights):
        layer = module.smoe_layer
        out = torch.zeros_like(hidden_states)
        experts = torch.unique(top_k_index).tolist()
        for batch in self.batches(layer, experts):
            prepared = self.store.get(layer, batch)
            for e in batch:
                token_idx, slot = torch.where(top_k_index == e)
                weight = top_k_weights[token_idx, slot, None]
                if getattr(module, "smoe_scale_input", False):
                    y = self.expert_output(module, prepared[e], hidden_states[token_idx] * weight.to(hidden_states.dtype))
                else:
                    y = self.expert_output(module, prepared[e], hidden_states[token_idx])
                    y = y * weight.to(y.dtype)
                out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def batches(self, layer: int, experts: list[int]) -> list[list[int]]:
        """Experts grouped so that one group's prepared weights fit the cache budget together: a long
        prompt's layer may route to more experts than fit, and then reads them group by group."""
        if not self.largest_expert:
            self.largest_expert = max(self.store.min_budget(1), 1)
        per_group = max(1, self.store.cache_bytes // self.largest_expert)
        return [experts[i : i + per_group] for i in range(0, len(experts), per_group)]

    def expert_output(self, module, expert, x):
        """One expert as transformers computes it: gate/up, the module's own gating, down."""
        if module.has_gate:
            gate, up = kernels_cpu.gate_and_up(x, expert)
            if module.is_concatenated:
                gate_up = torch.cat([gate, up], dim=-1)
            else:  # interleaved [g0, u0, g1, u1, ...] (gpt-oss)
                gate_up = torch.stack([gate, up], dim=-1).flatten(-2)
            h = module._apply_gate(gate_up)
        else:
            h = module.act_fn(kernels_cpu.linear(x, expert, "up"))
        y = kernels_cpu.linear(h, expert, "down")
        if getattr(module, "has_post_expert_norm", False):
            y = module.post_expert_norm(y)
        return y


class StreamingModel:
    """A vault opened for inference on CPU: trunk resident, experts streamed through the store."""

    def __init__(self, vault_dir, dtype: str | torch.dtype = "bfloat16", cache_bytes: int | None = None,
                 threads: int = 16, direct_io: bool = False, kernel_path: str = "auto", device: str = "cpu",
                 gpu_cache_bytes: int | None = None):
        self.device = resolve_device(device)
        self.vault = Vault(vault_dir)
        self.store = self.gpu = None
        try:
            self._open(dtype, cache_bytes, threads, direct_io, kernel_path, device, gpu_cache_bytes)
        except BaseException:  # a failed open holds no file, thread or GPU memory: callers may retry
            self.close()
            raise

    def _open(self, dtype, cache_bytes, threads, direct_io, kernel_path, device, gpu_cache_bytes) -> None:
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        self.config = model_config(self.vault)
        prepare = lambda tensors, biases: as_sized(kernels_cpu.prepare_expert(tensors, biases, self.dtype, kernel_path,
                                                                              fuse=True))
        self.store = ExpertStore(self.vault, cache_bytes or 0, prepare, threads=threads, direct_io=direct_io)
        self.model = build_model(self.config, self.dtype)
        self.vault.check_trunk()
        load_trunk(self.model, self.vault, self.dtype)
        self.model.requires_grad_(False)  # inference only: no autograd graph, also when called directly
        self.engine = ExpertsEngine(self.store, tuple(self.vault.meta["roles"]))
        self.attach_experts()
        if self.device.type == "cuda" and device == "auto" and not gpu_supported(self):
            self.device = torch.device("cpu")  # auto: the families the GPU path lacks run on the CPU
        if self.device.type == "cuda":
            self.gpu = GpuRuntime(self, gpu_cache_bytes, host_cache_bytes=cache_bytes or 0, threads=threads,
                                  direct_io=direct_io)
        else:
            if cache_bytes is None:  # the default counts experts in their prepared (compute) size
                self.store.cache_bytes = default_cache_bytes(self.vault, self.store.prepare_ratio())
            self.check_budget()

    def attach_experts(self) -> None:
        for layer, module in experts_modules(self.model, self.vault).items():
            module.smoe_layer = layer
            module.smoe_engine = self.engine

    def check_budget(self) -> None:
        top_k = self.vault.meta.get("top_k") or 1
        need = self.store.min_budget(top_k)
        if self.store.cache_bytes < need:
            raise SmoeError(f"--cache-gb {self.store.cache_bytes / 1e9:.4g} is smaller than one token's {top_k} experts "
                            f"of a layer: at least {need / 1e9:.4g} GB ({need:,} bytes) is needed")

    def lean_decoder(self, positions: int):
        """The lean decode path when this family has one (else None), with a KV cache of at least
        `positions`; kept between calls and regrown (doubling) when a longer sequence comes."""
        from smoe import fast_decode

        if self.gpu is not None:
            return self.gpu.decoder(positions)
        if not fast_decode.supports(self):
            return None
        current = getattr(self, "_lean", None)
        if current is None or current.max_positions < positions:
            self._lean = fast_decode.LeanDecoder(self, kv_capacity(current, positions, self.max_positions))
        self._lean.reset()
        return self._lean

    @property
    def max_positions(self) -> int | None:
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        return getattr(text, "max_position_embeddings", None)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [B, T, V] in fp32 (on the CPU)."""
        if self.gpu is not None:
            return torch.stack([self.gpu.decoder(row.numel()).forward(row.tolist()).cpu() for row in input_ids])
        return self.model(input_ids=input_ids, use_cache=False).logits.float()

    def cache_stats(self) -> dict:
        """hits, misses, bytes_read, wait_seconds of whichever expert cache runs the experts."""
        return (self.gpu.decoder_stats() if self.gpu is not None else self.store.stats.as_dict())

    def close(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
        if self.store is not None:
            self.store.close()
        self.vault.close()


class GpuRuntime:
    """The GPU side of a StreamingModel: one GpuDecoder (trunk on the GPU, GPU expert cache), made on
    first use and remade with a longer KV cache when a longer sequence comes."""

    def __init__(self, sm: StreamingModel, gpu_cache_bytes: int | None, host_cache_bytes: int, threads: int,
                 direct_io: bool):
        if not gpu_supported(sm):
            raise SmoeError(f"the GPU runtime runs the Qwen3-MoE and Mixtral layouts; {sm.vault.meta['family']} "
                            "runs on the CPU (--device cpu)")
        self.sm, self.host_cache_bytes, self.threads, self.direct_io = sm, host_cache_bytes, threads, direct_io
        self.gpu_cache_bytes = gpu_cache_bytes if gpu_cache_bytes is not None else default_gpu_cache_bytes(sm)
        self._decoder = None
        self.decoder(1)  # fail early: budget too small, out of memory

    def decoder(self, positions: int):
        from smoe.gpu_decode import GpuDecoder

        current = self._decoder
        if current is None or current.max_positions < positions:
            capacity = kv_capacity(current, positions, self.sm.max_positions)
            if capacity < positions:
                raise SmoeError(f"sequence of {positions} tokens exceeds the model's context of {capacity}")
            stats = current.cache.stats if current else None
            if current is not None:
                current.close()
                self._decoder = None
                torch.cuda.empty_cache()
            self._decoder = GpuDecoder(self.sm, self.sm.device, self.gpu_cache_bytes, capacity, self.host_cache_bytes,
                                       threads=self.threads, direct_io=self.direct_io)
            if stats is not None:
                self._decoder.cache.stats = stats
        self._decoder.reset()
        return self._decoder

    def decoder_stats(self) -> dict:
        return self._decoder.cache.stats.as_dict()

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.close()


def kv_capacity(current, positions: int, limit: int | None) -> int:
    """KV-cache positions for a decoder that must hold `positions`: at least 1024, doubling the
    current decoder's, never past the model's context `limit`."""
    capacity = max(positions, 2 * current.max_positions if current else 1024)
    return min(capacity, limit or capacity)


def gpu_supported(sm: StreamingModel) -> bool:
    from smoe import fast_decode

    return fast_decode.supports(sm)


def default_gpu_cache_bytes(sm: StreamingModel) -> int:
    """Every expert when they fit in 80% of the GPU memory free after the trunk, else that 80%."""
    from smoe.gpu_cache import blob_slot_bytes

    everything = blob_slot_bytes(sm.vault) * len(sm.vault.entries)
    free, _ = torch.cuda.mem_get_info(sm.device)
    trunk = sum(p.numel() * p.element_size() for p in sm.model.parameters() if p.device.type != "meta")
    return int(min(everything, 0.8 * max(free - trunk, 0)))


def as_sized(prepared) -> tuple[object, int]:
    return prepared, prepared.nbytes


def model_config(vault: Vault):
    """The transformers configuration of the vault's config.json (read and checksummed once, at open),
    its routing and shape values checked before any decoder sees them."""
    config = vault.config
    if config is None:
        raise SmoeError(f"{vault.dir}: no config.json")
    check_model_config(config, vault.meta["num_experts"], str(vault.dir / "config.json"))
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise SmoeError(f"{vault.dir / 'config.json'}: model_type {model_type!r} is unknown to transformers "
                        f"{transformers.__version__}")
    config_class = CONFIG_MAPPING[model_type]
    try:  # as from_pretrained reads a file: {"__float__": "Infinity"} back to a float first
        return config_class.from_dict(config_class._decode_special_floats(config))
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise SmoeError(f"{vault.dir / 'config.json'}: transformers cannot read it ({str(e)[:120]})") from None


def causal_lm_class(config):
    """The class the checkpoint declares in `architectures`, else the Auto causal-LM mapping."""
    model_class = getattr(transformers, (config.architectures or [""])[0], None)
    return model_class if model_class is not None else AutoModelForCausalLM


def build_model(config, dtype: torch.dtype, streaming: bool = True):
    """The transformers model with every parameter on the meta device (nothing allocated yet); with
    `streaming`, MoE blocks outside the experts registry are swapped for streaming ones."""
    model_class = causal_lm_class(config)
    kwargs = {"experts_implementation": EXPERTS_IMPLEMENTATION, "dtype": dtype}
    try:
        with torch.device("meta"):
            if model_class is AutoModelForCausalLM:
                model = model_class.from_config(config, **kwargs)
            else:
                model = model_class._from_config(config, **kwargs)  # what the Auto classes call
    except ValueError as e:
        raise SmoeError(f"cannot build a {config.model_type} model with transformers: {e}") from None
    if streaming:
        replace_unregistered_moe_blocks(model)
    return model.eval()


def load_trunk(model, vault: Vault, dtype: torch.dtype | None, is_experts=is_experts_module) -> None:
    """Assign the trunk tensors (renamed as transformers renames checkpoint keys), each checked against
    the model built from config. Floating tensors take the dtype the model holds them in (built with
    `dtype`; fp32 where it makes a buffer in fp32); dtype None keeps them as stored (to write them out)."""
    rebuild_meta_buffers(model)  # first: nothing that initialises runs after the trunk is in
    trunk = read_trunk(model, vault, cast=dtype is not None)
    model.load_state_dict(trunk, strict=False, assign=True)
    for tensor in model.state_dict(keep_vars=True).values():
        if not tensor.is_meta:
            tensor._is_hf_initialized = True  # so that an init_weights transformers runs later keeps them
    model.tie_weights(missing_keys=set(model.state_dict()) - set(trunk), recompute_mapping=False)
    check_trunk_reached(model, trunk)
    missing = [n for n, p in model.named_parameters() if p.is_meta and not is_experts_param(model, n, is_experts)]
    if missing:
        raise SmoeError(f"trunk is missing {len(missing)} tensors the model needs (first: {missing[:3]})")


def read_trunk(model, vault: Vault, cast: bool) -> dict[str, torch.Tensor]:
    """The vault's trunk under the model's names. A tensor of another shape than the model's, or one the
    model lacks (beyond those transformers itself leaves out on load), is an error."""
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected, ignorable = model.state_dict(), ignored_on_load(model)
    trunk, sources, unknown = {}, {}, []
    for key, tensor in load_file(vault.trunk_path).items():
        name, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if name not in expected:
            unknown += [] if ignorable(name) else [key]
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise SmoeError(f"trunk tensor {key}: shape {tuple(tensor.shape)} in the vault, "
                            f"{tuple(expected[name].shape)} in the model config.json builds")
        if name in trunk:
            raise SmoeError(f"trunk tensors {sources[name]} and {key} both load into {name}")
        trunk[name], sources[name] = cast_as(tensor, expected[name]) if cast else tensor, key
    if unknown:
        raise SmoeError(f"the trunk has {len(unknown)} tensors the {type(model).__name__} built from config.json "
                        f"lacks (first: {unknown[:3]}): a checkpoint of another layout or version?")
    return trunk


def cast_as(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return tensor.to(like.dtype) if tensor.is_floating_point() and like.is_floating_point() else tensor


def ignored_on_load(model):
    """Checkpoint keys transformers drops on load without a word: those the model class declares
    (`_keys_to_ignore_on_load_unexpected`, e.g. DeepSeek-V3's multi-token-prediction layer 61) and
    stored copies of buffers the model computes itself (old checkpoints' rotary inv_freq, position_ids)."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    regex = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    state = model.state_dict()
    computed = {n.rsplit(".", 1)[-1] for n, _ in model.named_buffers() if n not in state}
    return lambda name: name.rsplit(".", 1)[-1] in computed or (regex is not None and regex.search(name) is not None)


def check_trunk_reached(model, trunk: dict[str, torch.Tensor]) -> None:
    """Proof, by storage, that the model holds each trunk tensor itself: a load hook that copied or
    dropped one, or a tie that replaced one, shows here. (Ties join tensors of equal value only.)"""
    tied = model.all_tied_weights_keys
    partner = dict(tied) | {source: target for target, source in tied.items()}
    for name, tensor in trunk.items():
        held = model.get_parameter_or_buffer(name).data_ptr()
        other = trunk.get(partner.get(name))
        if held != tensor.data_ptr() and (other is None or held != other.data_ptr()):
            raise SmoeError(f"trunk tensor {name}: the model does not hold the stored tensor after loading")


def experts_modules(model, vault: Vault, is_experts=is_experts_module) -> dict[int, torch.nn.Module]:
    """layer -> the model's experts module, one for every MoE layer of the vault."""
    layers = set(vault.meta["moe_layers"])
    found = {}
    for name, module in model.named_modules():
        if is_experts(module):
            match = LAYER_RE.search(f".{name}.")
            if not match or int(match.group(1)) not in layers:
                raise SmoeError(f"experts module {name}: no matching MoE layer in the vault")
            found[int(match.group(1))] = module
    if set(found) != layers:
        raise SmoeError(f"{vault.meta['family']}: the model has experts modules for layers {sorted(found)}, the vault "
                        f"has {sorted(layers)} (this family's MoE block is not supported by the runtime yet)")
    return found


def is_experts_param(model, name: str, is_experts=is_experts_module) -> bool:
    """Whether a parameter lives inside an experts module (whose weights come from the vault)."""
    parts = name.split(".")[:-1]
    return any(is_experts(model.get_submodule(".".join(parts[:i]))) for i in range(1, len(parts) + 1))


def rebuild_meta_buffers(model) -> None:
    """Buffers computed at construction (rotary inv_freq, embedding scales) were made on meta: give
    them storage and let transformers' own initialisation fill them. It runs before the trunk is
    loaded: parameters are still on meta, flagged so that initialisation leaves them alone."""
    persistent = set(model.state_dict())
    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta:
            owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
            model.get_submodule(owner).register_buffer(
                leaf, torch.empty_like(buffer, device="cpu"), persistent=name in persistent)
    for p in model.parameters():
        p._is_hf_initialized = True  # transformers' marker for "loaded": init_weights skips these
    model.init_weights()
