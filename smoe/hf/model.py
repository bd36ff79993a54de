"""transformers models built from a vault: the configuration, the skeleton on the meta device, the trunk.

The trunk is loaded into the skeleton with transformers' own checkpoint-key renamings, and every
trunk tensor is checked to be held by the model afterwards (a load hook or tie that dropped one fails).
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import sys
from pathlib import Path

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from smoe.errors import SmoeError
from smoe.format.safetensors_io import load_tensors
from smoe.format.vault import Vault
from smoe.hf.experts import EXPERTS_IMPLEMENTATION, is_experts_module, layer_of, replace_unregistered_moe_blocks
from smoe.source.config_checks import check_vault_config, show_value


def model_config(vault: Vault):
    """The transformers configuration of the vault's config.json (read and checksummed once, at open),
    its routing and shape values checked before any decoder sees them."""
    config = vault.config
    if config is None:
        raise SmoeError(f"{vault.dir}: no config.json")
    where = str(vault.dir / "config.json")
    check_vault_config(config, vault.meta, vault.dir)
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise SmoeError(f"{where}: model_type {model_type!r} is unknown to transformers {transformers.__version__}")
    return read_config(config, where)


def read_config(config: dict, where: str):
    """transformers' configuration of a config dict, as from_pretrained reads a file ({"__float__": "Infinity"}
    back to a float first); what transformers refuses is one line naming the key."""
    config_class = CONFIG_MAPPING[config["model_type"]]
    try:
        return config_class.from_dict(config_class._decode_special_floats(config))
    except Exception as e:  # strict dataclass validators raise their own types
        raise refusal(e, config, where, lambda c: config_class.from_dict(config_class._decode_special_floats(c))) from None


KEY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*_[A-Za-z0-9_]+\Z")  # names a message may quote: rms_norm_eps, not "0"


def refusal(error: Exception, config: dict, where: str, attempt) -> SmoeError:
    """transformers' refusal of a config as one line naming the key it is about: the key its message names,
    else the key holding the value it names (an ACT2FN or rope KeyError), else the one key without which
    `attempt(config)` succeeds."""
    if isinstance(error, SmoeError):
        return error
    text = " ".join(str(error).split())
    leaves = dict(config_leaves(config))
    named = [k for k in leaves if KEY_NAME.match(k.rsplit(".", 1)[-1]) and re.search(rf"\b{k.rsplit('.', 1)[-1]}\b", text)]
    valued = [k for k, v in leaves.items() if isinstance(v, str) and error.args and error.args[0] == v]
    key = max(named, key=len) if named else valued[0] if valued else culprit(config, attempt)
    said = f"{key} is {show_value(leaves[key])}: " if key else ""
    return SmoeError(f"{where}: {said}transformers {transformers.__version__} cannot build the model from it "
                     f"({type(error).__name__}: {text[:160]})")


def config_leaves(config: dict, prefix: str = ""):
    """("a.b", value) of every value in a config dict and the dicts nested in it."""
    for key, value in config.items():
        if isinstance(value, dict):
            yield from config_leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def culprit(config: dict, attempt) -> str | None:
    """The key whose removal (the class's default instead) lets `attempt` succeed; only on an error's path."""
    for key, _ in config_leaves(config):
        if key in ("model_type", "architectures"):
            continue
        *parents, leaf = key.split(".")
        trial = json.loads(json.dumps(config))
        scope = trial
        for part in parents:
            scope = scope[part]
        del scope[leaf]
        try:
            attempt(trial)
        except Exception:
            continue
        return key
    return None


def causal_lm_class(config):
    """The class the checkpoint declares in `architectures`, else the Auto causal-LM mapping, else (a
    multimodal model_type without a causal-LM class) the image-text-to-text one: smoe runs it on text
    alone, its vision and audio towers kept, unquantised, in the trunk."""
    model_class = getattr(transformers, (config.architectures or [""])[0], None)
    if model_class is not None:
        return model_class
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def build_model(config, dtype: torch.dtype, streaming: bool = True, where: str = "config.json"):
    """The transformers model with every parameter on the meta device (nothing allocated yet); with
    `streaming`, MoE blocks outside the experts registry are swapped for streaming ones. A value its
    modules cannot use (an unknown activation or rope type, a head size of 0) is one line naming the key."""
    try:
        model = skeleton(config, dtype)
    except Exception as e:  # a value transformers looks up or divides by: one line naming the key
        source = config.to_dict()
        raise refusal(e, source, where, lambda c: skeleton(read_config(c, where), dtype)) from None
    if streaming:
        replace_unregistered_moe_blocks(model)
    return model.eval()


def skeleton(config, dtype: torch.dtype):
    model_class = causal_lm_class(config)
    kwargs = {"experts_implementation": EXPERTS_IMPLEMENTATION, "dtype": dtype}
    with torch.device("meta"):
        if model_class in (AutoModelForCausalLM, AutoModelForImageTextToText):
            return model_class.from_config(config, **kwargs)
        return model_class._from_config(config, **kwargs)  # what the Auto classes call


def check_buildable(config: dict, trunk: dict[str, tuple[int, ...]], where: str) -> None:
    """Before quantizing: transformers builds the model of `config` (on the meta device, nothing allocated)
    and holds every trunk tensor (name -> shape) at that shape, as opening the vault will require. A model
    type transformers does not know is left to the family checks (an export may still take it), with a
    notice saying so: the vault will not open here."""
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise SmoeError(f"{where}: model_type is missing: it names the model's family, which the vault keeps")
    if config.get("model_type") not in CONFIG_MAPPING:
        print(f"smoe: notice: {where}: model_type {config.get('model_type')!r} is unknown to transformers "
              f"{transformers.__version__}, so only smoe's family checks ran on its config; the vault can be "
              "exported, but smoe runs it only with a transformers that knows the type", file=sys.stderr)
        return
    model = build_model(read_config(config, where), torch.float32, where=where)
    missing = unplaced(model, place_trunk(model, trunk, "the checkpoint"))
    if missing:  # the vault would open nowhere, and its exports would not load
        raise SmoeError(f"{where}: the checkpoint lacks {len(missing)} tensors the model needs (first: {missing[:3]})")


def unplaced(model, placed: set[str]) -> list[str]:
    """The model's parameters outside its experts that neither `placed` nor a tie to a placed one fills."""
    partner = tie_partners(model)
    return [name for name, _ in model.named_parameters()
            if name not in placed and partner.get(name) not in placed and not is_experts_param(model, name)]


def trunk_shapes(config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor the model of `config` loads but its routed experts, as the model
    holds them (built on the meta device): a trunk of these loads (a synthetic vault's, for benchmarks)."""
    model = build_model(read_config(config, "config"), torch.bfloat16, where="config")
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()
            if not is_experts_param(model, name)}


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
    """The vault's trunk under the model's names, through transformers' own conversions. A tensor of
    another shape than the model's, or one the model lacks (beyond those transformers itself leaves out
    on load), is an error."""
    tensors = load_tensors(vault.trunk_path)
    converted = convert_trunk(model, tensors, "the vault")
    expected = model.state_dict()
    for name, (keys, tensor) in converted.items():
        check_loadable(keys[0], tensor, expected[name])
    return {name: cast_as(tensor, expected[name]) if cast else tensor for name, (_, tensor) in converted.items()}


def place_trunk(model, shapes: dict[str, tuple[int, ...]], holder: str) -> set[str]:
    """The model's names a trunk of these shapes fills, converted on the meta device; a tensor that would not
    load is an error."""
    return set(convert_trunk(model, {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}, holder))


def convert_trunk(model, tensors: dict[str, torch.Tensor], holder: str) -> dict[str, tuple[tuple[str, ...], torch.Tensor]]:
    """model name -> (checkpoint keys, tensor) of a trunk, as transformers loads a checkpoint: its renamings,
    then its converters (merges of q/k/v or gate/up, splits of fused ones, interleaving, padding), which
    gather the keys they take and convert them together. A tensor of another shape than the model's (a
    router with more rows than the config's experts), or one the model lacks beyond those transformers
    itself leaves out on load (another model type's trunk), is an error."""
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    expected, ignorable = model.state_dict(), ignored_on_load(model)
    out, groups, unknown = {}, {}, []
    for key, tensor in sorted(tensors.items(), key=lambda item: natural_key(item[0])):
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if name not in expected and key in expected:  # as transformers: a renaming that misfired (DeepSeek-V4's
            name, pattern = rename_source_key(key, [], [], model.base_model_prefix, expected)  # ".norm." on model.norm)
        if pattern is None:
            _place(out, name, (key,), tensor)
            continue
        converter, keys = groups.setdefault(name, (copy.deepcopy(by_pattern[pattern]), []))
        converter.add_tensor(name, key, pattern, tensor)
        keys.append(key)
    for first, (converter, keys) in groups.items():
        try:
            produced = converter.convert(first, model=model, config=model.config)
        except Exception as e:  # a converter that cannot take what the trunk holds
            raise SmoeError(f"trunk tensors {', '.join(keys[:3])}: transformers' conversion into {first} fails "
                            f"({type(e).__name__}: {str(e)[:120]})") from None
        for name, tensor in produced.items():
            _place(out, name, tuple(keys), tensor[0] if isinstance(tensor, list) else tensor)
    for name in [n for n in out if n not in expected]:
        keys, _ = out.pop(name)
        unknown += [] if ignorable(name) else list(keys)
    if unknown:
        raise SmoeError(f"the trunk has {len(unknown)} tensors the {type(model).__name__} built from config.json "
                        f"lacks (first: {unknown[:3]}): a checkpoint of another model type, layout or version?")
    for name, (keys, tensor) in out.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            converted = f" converted into {name}" if name in groups or len(keys) > 1 else ""
            raise SmoeError(f"trunk tensor {', '.join(keys[:3])}: shape {tuple(tensor.shape)} in {holder}{converted}, "
                            f"{tuple(expected[name].shape)} in the model config.json builds")
    return out


def natural_key(name: str) -> list[tuple]:
    """Keys in transformers' load order: numbers numerically (expert 2 before expert 10), as merges stack them."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split(".")]


def _place(out: dict, name: str, keys: tuple[str, ...], tensor: torch.Tensor) -> None:
    if name in out:
        raise SmoeError(f"trunk tensors {out[name][0][0]} and {keys[0]} both load into {name}")
    out[name] = (keys, tensor)


def check_loadable(key: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    """A float tensor where the model holds a float one, else the model's own dtype: an int8 norm weight
    would be assigned as it is and fail inside the first matmul."""
    if tensor.is_floating_point() != like.is_floating_point() or not (tensor.is_floating_point() or tensor.dtype == like.dtype):
        raise SmoeError(f"trunk tensor {key}: {str(tensor.dtype).removeprefix('torch.')} in the vault, the model "
                        f"holds it as {str(like.dtype).removeprefix('torch.')}")


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


def tie_partners(model) -> dict[str, str]:
    """Each tied parameter's name -> the name it is tied to, both ways."""
    tied = model.all_tied_weights_keys
    return dict(tied) | {source: target for target, source in tied.items()}


def check_trunk_reached(model, trunk: dict[str, torch.Tensor]) -> None:
    """Proof, by storage, that the model holds each trunk tensor itself: a load hook that copied or
    dropped one, or a tie that replaced one, shows here. (Ties join tensors of equal value only.)"""
    partner = tie_partners(model)
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
            layer = layer_of(name)
            if layer not in layers:
                raise SmoeError(f"experts module {name}: no matching MoE layer in the vault")
            found[layer] = module
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



def forward_with_cache(model, input_ids: torch.Tensor, cache=None):
    """(logits, cache): the model's forward continuing `cache` (None: a new sequence, for which the model
    builds the cache of its own kind, e.g. MiniMax's or a hybrid model's). transformers renamed
    `past_key_values` to `cache` (5.2x), in the forward's keywords and in its outputs; either release works."""
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=input_ids, use_cache=True, **({keyword: cache} if cache is not None else {}))
    return out.logits, out["cache"] if "cache" in out else out["past_key_values"]


def new_cache(model):
    """An empty cache of the kind the model's forward makes for a new sequence: transformers' DynamicCache from
    the config, one layer object per layer type (linear-attention and state-space layers included)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config.get_text_config())


def run_layer(layer, hidden: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """hidden [1, T, H] after one of the family's own decoder layers at positions [1, T], continuing `cache`
    (new_cache's). No mask: one sequence without padding, and the layers run this way (linear attention,
    state-space mixers) mask nothing else."""
    params = inspect.signature(layer.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    keyword = "cache" if "cache" in params else "past_key_values"
    given = {"attention_mask": None, "position_ids": positions, "position_embeddings": None, "use_cache": True,
             keyword: cache}
    out = layer(hidden, **{k: v for k, v in given.items() if k in params or takes_any})
    return out[0] if isinstance(out, tuple) else out


def random_model(config: dict, dtype: torch.dtype, device: str):
    """A randomly initialised model of a config dict (the transformers peer of the decode benchmark)."""
    config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def generation_config(directory):
    """The directory's generation_config.json as transformers reads it, or None without one."""
    path = Path(directory) / "generation_config.json"
    return GenerationConfig.from_pretrained(directory) if path.exists() else None


def load_pretrained(model_dir, dtype=torch.float32, experts_implementation: str | None = None, purpose: str = ""):
    """The checkpoint as transformers loads it (the reference for eval, the source for calibration);
    `purpose` ("for calibration") completes the error message."""
    config = AutoConfig.from_pretrained(model_dir)
    kwargs = {"dtype": dtype}
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    try:
        return causal_lm_class(config).from_pretrained(model_dir, **kwargs).eval()
    except (OSError, ValueError) as e:
        raise SmoeError(f"{model_dir}: transformers cannot load this model{purpose and ' ' + purpose} ({e})") from None


REFERENCE_SHAPE = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def check_reference(model_dir, config) -> None:
    """The reference must be the model the vault was made from (its family and shapes, read from its config):
    another model's logits give a KL and top-1 that mean nothing."""
    try:
        ref = AutoConfig.from_pretrained(model_dir).get_text_config()
    except (OSError, ValueError, KeyError) as e:
        raise SmoeError(f"{model_dir}: its config.json does not read as a model's ({str(e).splitlines()[0]})") from None
    ours = config.get_text_config()
    differ = [f"{key} {getattr(ref, key, None)!r} (the vault's {getattr(ours, key, None)!r})" for key in REFERENCE_SHAPE
              if getattr(ref, key, None) != getattr(ours, key, None)]
    if differ:
        raise SmoeError(f"{model_dir}: not the model the vault was made from: {', '.join(differ)}")
