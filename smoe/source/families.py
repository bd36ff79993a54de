"""Model-family rules: where each family keeps its routed experts, and how to read one expert.

This is the only module that knows tensor names and config keys.  A family is a row of FAMILIES: the
model_types it answers to, the on-disk layouts its routed experts may come in (`layouts`), and which
config keys hold the expert intermediate size.  Everything else is shared:

* a tensor name is split into <prefix><layers|blocks>.<L>.<rest>; <rest> with its expert number
  replaced by "{e}" is looked up in the family's layouts (one dict lookup per name), so shared
  experts, dense MLPs, routers and vision towers simply never match;
* the config says how many experts, how many layers and which layers are MoE (CONFIG_KEYS and
  _config_moe_layers); where it does not, the names say it;
* map_experts then counts: every MoE layer x every expert x every role, or a SmoeError;
* check_model_config holds every routing and shape value the runtime reads to its kind and range
  (CONFIG_VALUES, and the relations between them), when quantising and when a vault is opened.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import torch

from smoe.errors import SmoeError

GATED = ("gate", "up", "down")
NON_GATED = ("up", "down")


# ----- the contract (docs/ARCHITECTURE.md) ---------------------------------------------------------


@dataclass(frozen=True)
class ProjectionSource:
    """Where one projection of one routed expert lives."""

    role: str  # "gate" | "up" | "down"
    name: str  # logical checkpoint tensor name
    expert_index: int | None  # dim-0 index into a fused [E, ...] tensor; None for a per-expert tensor
    transpose: bool  # stored [in, out] -> transpose to [out, in]
    part: int = 0  # after transpose, rows split into `parts` pieces (concatenated gate_up):
    parts: int = 1  # take piece `part`
    interleaved: bool = False  # pieces interleaved row-wise (rows part::parts) instead of contiguous chunks
    stacked: int = 0  # >0: a 2-D tensor stacking this many experts' blocks along dim 0 (dbrx);
    #                   expert_index picks the block, before any transpose


@dataclass(frozen=True)
class BiasSource:
    """Per-expert bias (gpt-oss), same addressing as ProjectionSource, 1-D result [out]."""

    role: str
    name: str
    expert_index: int | None
    part: int = 0
    parts: int = 1
    interleaved: bool = False


@dataclass
class ExpertMap:
    family: str  # canonical family name, e.g. "qwen3_moe"
    model_type: str  # as in config, e.g. "kimi_k2" for the deepseek_v3 family
    moe_layers: list[int]
    num_experts: int
    top_k: int | None
    roles: tuple[str, ...]  # ("gate", "up", "down") or ("up", "down")
    experts: dict[tuple[int, int], list[ProjectionSource]]  # (layer, expert) -> projections in `roles` order
    biases: dict[tuple[int, int], list[BiasSource]]  # empty unless the family has expert biases
    expert_names: set[str]  # logical names that belong to routed experts (the rest is trunk)
    hidden_size: int | None = None
    expert_intermediate_size: int | None = None
    expert_input_size: int | None = None  # hidden_size, or a latent size where experts work in one

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """role -> (out, in), from config; {} when the config lacks the sizes."""
        inner, outer = self.expert_intermediate_size, self.expert_input_size or self.hidden_size
        if not inner or not outer:
            return {}
        shapes = {"gate": (inner, outer), "up": (inner, outer), "down": (outer, inner)}
        return {role: shapes[role] for role in self.roles}


# ----- layouts: how one family's experts may be stored ------------------------------------------


@dataclass(frozen=True)
class Stored:
    """How one role (or bias) is stored, as a name relative to the decoder layer.

    "{e}" in `template` marks a per-expert tensor; without it the tensor holds every expert
    (fused [E, ...], or `stacked` along dim 0 of a 2-D tensor).
    """

    template: str
    transpose: bool = False
    part: int = 0
    parts: int = 1
    interleaved: bool = False
    stacked: bool = False


@dataclass(frozen=True)
class Layout:
    what: str  # a few words for messages
    roles: dict[str, Stored]
    biases: dict[str, Stored] = field(default_factory=dict)
    marker: str | None = None  # a tensor the layer must hold to be MoE (moondream: dense and MoE blocks share names)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def per_expert(block: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
               experts: str = "experts", gated: bool = True) -> Layout:
    """experts.{e}.<proj>.weight, each [out, in] (the Hugging Face release layout of most families)."""
    names = {"gate": gate, "up": up, "down": down} if gated else {"up": up, "down": down}
    base = _join(block, experts, "{e}")
    return Layout(
        f"per-expert {_join(block, experts)}.E.*",
        {role: Stored(f"{base}.{proj}.weight") for role, proj in names.items()},
        {role: Stored(f"{base}.{proj}.bias") for role, proj in names.items()},
    )


def fused_gate_up(container: str, gate_up: str = "gate_up_proj", down: str = "down_proj",
                  transpose: bool = False, interleaved: bool = False, bias: str | None = None) -> Layout:
    """gate_up [E, 2I, H] + down [E, H, I]; transpose=True: [E, H, 2I] + [E, I, H]."""
    roles = {
        "gate": Stored(_join(container, gate_up), transpose, 0, 2, interleaved),
        "up": Stored(_join(container, gate_up), transpose, 1, 2, interleaved),
        "down": Stored(_join(container, down), transpose),
    }
    biases = {}
    if bias is not None:
        biases = {
            "gate": Stored(_join(container, gate_up + bias), False, 0, 2, interleaved),
            "up": Stored(_join(container, gate_up + bias), False, 1, 2, interleaved),
            "down": Stored(_join(container, down + bias)),
        }
    return Layout(f"fused {_join(container, gate_up)}", roles, biases)


def fused_each(container: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
               gated: bool = True, suffix: str = ".weight", transpose: bool = False) -> Layout:
    """One [E, out, in] tensor per role (MLX switch_mlp; transformers' non-gated experts)."""
    names = {"gate": gate, "up": up, "down": down} if gated else {"up": up, "down": down}
    roles = {role: Stored(_join(container, proj) + suffix, transpose) for role, proj in names.items()}
    biases = {role: Stored(_join(container, proj) + ".bias") for role, proj in names.items()} if suffix else {}
    return Layout(f"fused {container}.*", roles, biases)


def standard(block: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
             fused_transpose: bool = False) -> tuple[Layout, ...]:
    """A gated family: per-expert release layout, transformers-v5 fused layout, MLX switch_mlp."""
    return (
        per_expert(block, gate, up, down),
        fused_gate_up(_join(block, "experts"), transpose=fused_transpose),
        fused_each(_join(block, "switch_mlp")),
    )


MIXTRAL_NAMES = ("w1", "w3", "w2")  # gate, up, down
EXPERT_WIDTH = ("intermediate_size",)  # families whose experts take the plain intermediate_size


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config model_type values (lower case, "-" -> "_")
    layouts: tuple[Layout, ...]  # the ways its routed experts are found stored
    intermediate_keys: tuple[str, ...] = ("moe_intermediate_size",)  # expert width in the config
    roles: tuple[str, ...] = GATED
    hint: str | None = None  # a trunk-name fragment that prefers this family when there is no config
    identity_key: str | None = None  # config key counting identity experts numbered after the routed ones
    latent_keys: tuple[str, ...] = ()  # config key of a latent width the experts take in, beside moe_latent_size


# One row per family.  Fused orientations are the ones the transformers modules compute with
# (models/*/modeling_*.py): gate_up [E, 2I, H] and down [E, H, I] unless noted.
# Without a config the first row whose layouts match the names wins, so the order matters there.
FAMILIES: tuple[Family, ...] = (
    Family("qwen3_moe", ("qwen3_moe",), standard("mlp")),
    Family("qwen2_moe", ("qwen2_moe",), standard("mlp"), hint=".shared_expert_gate."),
    Family("qwen3_next", ("qwen3_next",), standard("mlp")),
    # the official release is fused, REAP-pruned copies are per expert
    Family("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), standard("mlp")),
    Family("olmoe", ("olmoe",), standard("mlp"), EXPERT_WIDTH),
    Family("deepseek_v3", ("deepseek_v3", "kimi_k2", "deepseek_v32", "glm4_moe_lite"), standard("mlp"),
           hint=".shared_experts."),
    Family("deepseek_v2", ("deepseek_v2", "deepseek_vl_v2", "deepseekocr", "deepseek_ocr"), standard("mlp")),
    Family("mistral4", ("mistral4",), standard("mlp")),
    Family("glm4_moe", ("glm4_moe",), standard("mlp")),
    Family("mixtral", ("mixtral", "minimax_m1", "minimax_text_01"), standard("block_sparse_moe", *MIXTRAL_NAMES),
           EXPERT_WIDTH),
    Family("minimax", ("minimax",), standard("block_sparse_moe", *MIXTRAL_NAMES), EXPERT_WIDTH),
    Family("minimax_m2", ("minimax_m2",), standard("block_sparse_moe", *MIXTRAL_NAMES), EXPERT_WIDTH),
    Family("phimoe", ("phimoe",), standard("block_sparse_moe", *MIXTRAL_NAMES), EXPERT_WIDTH),
    Family("jamba", ("jamba",), standard("feed_forward"), EXPERT_WIDTH),
    Family("ernie4_5_moe", ("ernie4_5_moe",), standard("mlp")),
    Family("hunyuan_v1_moe", ("hunyuan_v1_moe",), standard("mlp"), EXPERT_WIDTH),
    Family("dots1", ("dots1",), standard("mlp")),
    Family("exaone_moe", ("exaone_moe",), standard("mlp")),
    Family("afmoe", ("afmoe",), standard("mlp")),
    Family("lfm2_moe", ("lfm2_moe",), standard("feed_forward", *MIXTRAL_NAMES)),
    # gate_up [E, H, 2I] with gate and up in alternate columns, down [E, I, H], biases [E, 2I] / [E, H];
    # MLX de-interleaves them into experts.{gate,up,down}_proj [E, out, in] (+ .bias)
    Family("gpt_oss", ("gpt_oss",), (
        fused_gate_up("mlp.experts", transpose=True, interleaved=True, bias="_bias"),
        fused_each("mlp.experts"),
    ), EXPERT_WIDTH),
    # the bf16 release is fused [E, H, 2I] / [E, I, H], the FP8 release per expert
    Family("llama4", ("llama4", "llama4_text"), standard("feed_forward", fused_transpose=True), EXPERT_WIDTH),
    Family("granitemoe", ("granitemoe", "granitemoeshared", "granitemoehybrid"), (
        fused_gate_up("block_sparse_moe", "input_linear.weight", "output_linear.weight"),
        fused_gate_up("block_sparse_moe.experts"),
        fused_each("block_sparse_moe.switch_mlp"),
    ), EXPERT_WIDTH),
    # experts sit directly under the layer, beside a dense mlp that runs in parallel with them
    Family("gemma4", ("gemma4", "gemma4_text"), standard("")),
    # non-gated (relu^2): up, down
    Family("nemotron_h", ("nemotron_h",), (
        per_expert("mixer", gated=False),
        fused_each("mixer.experts", gated=False, suffix=""),
        fused_each("mixer.switch_mlp", gated=False),
        fused_each("mixer.switch_mlp", up="fc1", down="fc2", gated=False),
    ), roles=NON_GATED),
    # w1 (gate), v1 (up), w2 (down) are [E*I, H]: expert e is rows e*I:(e+1)*I; w2's block is [in, out]
    Family("dbrx", ("dbrx",), (
        Layout("stacked ffn.experts.mlp.{w1,v1,w2}", {
            "gate": Stored("ffn.experts.mlp.w1", stacked=True),
            "up": Stored("ffn.experts.mlp.v1", stacked=True),
            "down": Stored("ffn.experts.mlp.w2", transpose=True, stacked=True),
        }),
    ), ("ffn_config.ffn_hidden_size",)),
    # fc1 [E, 2I, H] (the gelu half first), fc2 [E, H, I]; dense blocks use the same names: only
    # MoE blocks have a router
    Family("moondream3", ("moondream3",), (
        Layout("fused mlp.fc1/fc2", fused_gate_up("mlp", "fc1.weight", "fc2.weight").roles,
               marker="mlp.router.weight"),
    ), ("moe.expert_inner_dim",)),
)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_NAME = {f.name: f for f in FAMILIES}
_ALIASES = sorted(t for f in FAMILIES for t in f.model_types if t != f.name)

# Where configs keep the MoE numbers, most specific first ("a.b" = nested dict).
CONFIG_KEYS = {
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                    "ffn_config.moe_num_experts", "moe.num_experts"),
    "top_k": ("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk", "moe_top_k", "moe_k",
              "experts_per_token", "moe_router_topk", "num_selected_experts", "ffn_config.moe_top_k", "moe.experts_per_token"),
    "hidden_size": ("hidden_size", "d_model", "n_embd"),
    "num_layers": ("num_hidden_layers", "n_layers", "num_layers", "n_layer"),
    "mtp_layers": ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers"),
    "latent_size": ("moe_latent_size",),
    "context_length": ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
}
NESTED_CONFIGS = ("text_config", "language_config", "llm_config", "thinker_config")


# Functions config -> Family, or why a model_type without a row has none (str), or None when they cannot
# tell (smoe.hf adds transformers' own: this layer cannot import transformers).
_DISCOVERERS: list = []


def add_discoverer(discover) -> None:
    if discover not in _DISCOVERERS:
        _DISCOVERERS.append(discover)


def _discovered(config: dict) -> Family | str | None:
    """The first discoverer's family, else the first reason one gives for having none."""
    answers = [discover(config) for discover in _DISCOVERERS]
    return next((a for a in answers if isinstance(a, Family)), next((a for a in answers if a), None))


def supported_families() -> list[str]:
    return [f.name for f in FAMILIES]


# ----- config reading ----------------------------------------------------------------------------


def _normalise_type(model_type) -> str:
    return str(model_type or "").strip().lower().replace("-", "_")


def _resolve(config: dict) -> tuple[Family | None, str, list[dict]]:
    """(family or None when no model_type, model_type as given, configs to read numbers from)."""
    nested = [config[k] for k in NESTED_CONFIGS if isinstance(config.get(k), dict)]
    # A wrapper (mistral3, gemma4, llama4, qwen3_5_moe, ...) names the text model in its text_config.
    for sub in nested:
        family = _BY_TYPE.get(_normalise_type(sub.get("model_type")))
        if family:
            return family, sub["model_type"], [sub, config]
    model_type = config.get("model_type")
    if not model_type:
        return None, "", [*nested, config]
    family = _BY_TYPE.get(_normalise_type(model_type)) or _discovered(config)
    if isinstance(family, str):
        raise SmoeError(f"unsupported model_type {model_type!r}: {family}")
    if family is None:
        raise SmoeError(f"unsupported model_type {model_type!r}; supported families: "
                        f"{', '.join(supported_families())} (aliases: {', '.join(sorted(_ALIASES))})")
    return family, model_type, [*nested, config]



def _lookup(configs: list[dict], keys: tuple[str, ...]):
    for cfg in configs:
        for key in keys:
            value = cfg
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None and not isinstance(value, dict):
                return value
    return None


def config_number(config: dict, what: str) -> int | None:
    """One of CONFIG_KEYS' numbers from a config, nested text configs first; None when absent."""
    return _int(_lookup(_resolve(config or {})[2], CONFIG_KEYS[what]))


def _num_layers(configs: list[dict]) -> int | None:
    n = _lookup(configs, CONFIG_KEYS["num_layers"])
    if n is None:  # nemotron_h keeps only the per-layer pattern
        pattern = _lookup(configs, ("layers_block_type", "hybrid_override_pattern"))
        n = len(pattern) if pattern else None
    return int(n) if n is not None else None


def _config_moe_layers(configs: list[dict], n: int) -> list[int]:
    """Which of the n decoder layers are MoE, by whichever convention the config follows."""

    def get(key):
        return _lookup(configs, (key,))

    explicit = get("moe_layers")  # llama4
    if isinstance(explicit, list):
        return sorted(int(i) for i in explicit)
    for key in ("layers_block_type", "layer_types"):  # nemotron_h: per-layer "moe"; others mean attention
        types = get(key)
        if isinstance(types, list) and "moe" in types:
            return [i for i, t in enumerate(types) if t == "moe"]
    pattern = get("hybrid_override_pattern")  # nemotron_h as released: "MEM*E..." (E = MoE)
    if isinstance(pattern, str):
        return [i for i, c in enumerate(pattern) if c == "E"]
    if get("enable_moe_block") is False:  # gemma4 without experts
        return []
    layers = list(range(n))
    mlp_types = get("mlp_layer_types")  # glm4_moe_lite, deepseek_v32, exaone_moe: "sparse" / "dense"
    if isinstance(mlp_types, list):  # deepseek_v4: "moe", or "hash_moe" (experts chosen by the token id)
        layers = [i for i in layers if i < len(mlp_types) and mlp_types[i] in ("sparse", "moe", "hash_moe")]
    mlp_only = get("mlp_only_layers") or []  # qwen
    step = get("decoder_sparse_step") or 1
    layers = [i for i in layers if i not in mlp_only and (i + 1) % step == 0]
    first_dense = get("first_k_dense_replace") or get("num_dense_layers") or 0  # deepseek & co; lfm2, afmoe
    freq = get("moe_layer_freq") or 1
    if isinstance(freq, list):  # megatron-style per-layer 0/1 list
        layers = [i for i in layers if i < len(freq) and freq[i]]
    else:
        layers = [i for i in layers if i >= first_dense and i % freq == 0]
    if get("moe_layer_start_index") is not None:  # ernie
        start, end = get("moe_layer_start_index"), get("moe_layer_end_index")
        end = n - 1 if end is None or end < 0 else end
        interval = get("moe_layer_interval") or 1
        layers = [i for i in layers if start <= i <= end and (i + 1) % interval == 0]
    period = get("expert_layer_period")  # jamba
    if period:
        offset = get("expert_layer_offset") or 0
        layers = [i for i in layers if i % period == offset]
    interleave = get("interleave_moe_layer_step")  # llama4 without moe_layers
    if interleave and interleave > 1:
        layers = [i for i in layers if i % interleave == interleave - 1]
    return layers


# ----- config values the runtime trusts ----------------------------------------------------------
#
# transformers builds its modules from these numbers and the compiled decode step indexes arrays by
# them without bounds checks: a bad value is refused when quantising and again when a vault is opened
# (one written by an older smoe may hold one), never met as a crash inside a kernel. Only keys present
# are checked; a key means the same in every family that uses it.


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# kind -> (test, what a value of that kind must be)
_KINDS = {
    "count": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "experts": (lambda v: _is_int(v) and v >= 1,
                "a positive integer (with no routed experts it is not a mixture-of-experts model)"),
    "size0": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "even": (lambda v: _is_int(v) and v >= 2 and v % 2 == 0,
             "a positive even integer (rotary embeddings turn pairs of its dimensions)"),
    "even0": (lambda v: _is_int(v) and v >= 0 and v % 2 == 0,
              "an even integer >= 0 (rotary embeddings turn pairs of its dimensions)"),
    "end": (lambda v: _is_int(v) and v >= -1, "a layer number, or -1 for the last layer"),
    "positive": (lambda v: _is_real(v) and v > 0, "a positive finite number"),
    # ranges of the numbers that reach arithmetic, far outside every released config, far inside what
    # overflows or underflows: a norm epsilon of 1e300 flattens every activation, a rope base of 1e-300
    # divides by zero
    "epsilon": (lambda v: _is_real(v) and 0 < v <= 0.1, "a number in (0, 0.1]"),
    "epsilon0": (lambda v: _is_real(v) and 0 <= v <= 0.1, "a number in [0, 0.1]"),
    "base": (lambda v: _is_real(v) and 1 <= v <= 1e12, "a number in [1, 1e12]"),
    "scale": (lambda v: _is_real(v) and 1e-6 <= v <= 1e6, "a number in [1e-6, 1e6]"),
    "real": (lambda v: _is_real(v) and abs(v) <= 1e6, "a number in [-1e6, 1e6]"),
    # -1 is how older converted configs say "none" (nn.Embedding takes padding_idx=-1 as the last row)
    "token": (lambda v: (_is_int(v) and v >= -1) or (isinstance(v, list) and bool(v) and all(_is_int(i) and i >= -1
                                                                                          for i in v)),
              "a token id (-1 for none), or a list of token ids"),
    "name": (lambda v: isinstance(v, str) and bool(v), "a name (a non-empty string)"),
    "names": (lambda v: isinstance(v, list) and all(isinstance(t, str) and t for t in v), "a list of names"),
    "fraction": (lambda v: _is_real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "factors": (lambda v: isinstance(v, list) and all(_is_real(x) and x > 0 for x in v),
                "a list of positive finite numbers"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "layers": (lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v), "a list of layer numbers"),
    "frequency": (lambda v: (_is_int(v) and v >= 1) or (isinstance(v, list) and all(_is_int(i) and i in (0, 1)
                                                                                     for i in v)),
                  "a positive integer, or a list of 0/1 per layer"),
}

# config key ("a.b" = nested) -> kind, under every name a supported family gives it
CONFIG_VALUES = {
    **dict.fromkeys(CONFIG_KEYS["num_experts"], "experts"),
    **dict.fromkeys(CONFIG_KEYS["top_k"], "count"),
    **dict.fromkeys(CONFIG_KEYS["hidden_size"], "count"),
    **dict.fromkeys(CONFIG_KEYS["num_layers"], "count"),
    **dict.fromkeys(CONFIG_KEYS["mtp_layers"], "size0"),
    **dict.fromkeys(CONFIG_KEYS["latent_size"], "count"),
    "vocab_size": "count", "max_position_embeddings": "count", "max_seq_len": "count",
    # attention heads (MLA ranks and head sizes included)
    "num_attention_heads": "count", "n_heads": "count", "num_key_value_heads": "count",
    "attn_config.kv_n_heads": "count", "num_global_key_value_heads": "count",
    "head_dim": "even0", "global_head_dim": "even", "q_lora_rank": "count", "kv_lora_rank": "count",  # head_dim 0: no rope
    "qk_rope_head_dim": "even0", "qk_nope_head_dim": "size0", "v_head_dim": "size0",  # 0 without MLA (deepseek-ocr)
    # MLP widths; shared experts may be absent (0)
    "intermediate_size": "count", "moe_intermediate_size": "count", "intermediate_size_mlp": "count",
    "ffn_config.ffn_hidden_size": "count", "moe.expert_inner_dim": "count",
    "shared_expert_intermediate_size": "size0", "moe_shared_expert_intermediate_size": "size0",
    "shared_intermediate_size": "size0", "n_shared_experts": "size0", "num_shared_experts": "size0",
    "moe_num_shared_experts": "size0", "num_shared_expert": "size0",
    # routing
    "n_group": "count", "topk_group": "count", "routed_scaling_factor": "scale", "norm_topk_prob": "flag",
    "route_scale": "scale",
    # which layers attend within a window or through another mixer (smoe.source.description)
    "max_window_layers": "size0", "attn_layer_period": "count", "attn_layer_offset": "size0",
    "full_attention_interval": "count",
    # which layers are MoE (_config_moe_layers)
    "decoder_sparse_step": "count", "moe_layer_freq": "frequency", "first_k_dense_replace": "size0",
    "num_dense_layers": "size0", "interleave_moe_layer_step": "count", "expert_layer_period": "count",
    "expert_layer_offset": "size0", "moe_layer_interval": "count", "moe_layer_start_index": "size0",
    "moe_layer_end_index": "end", "mlp_only_layers": "layers", "moe_layers": "layers",
    # linear-attention and state-space layers
    "linear_num_key_heads": "count", "linear_num_value_heads": "count", "linear_key_head_dim": "count",
    "linear_value_head_dim": "count", "linear_conv_kernel_dim": "count", "mamba_d_state": "count",
    "mamba_d_conv": "count", "mamba_expand": "count", "mamba_n_heads": "count", "mamba_d_head": "count",
    "mamba_n_groups": "count", "mamba_chunk_size": "count", "mamba_num_heads": "count", "mamba_head_dim": "count",
    "ssm_state_size": "count", "n_groups": "count", "chunk_size": "count", "conv_kernel": "count",
    "block_size": "count",
    # norms, positions, attention windows and scales
    "rms_norm_eps": "epsilon", "layer_norm_eps": "epsilon", "layer_norm_epsilon": "epsilon", "norm_eps": "epsilon",
    "rope_theta": "base", "attn_config.rope_theta": "base", "partial_rotary_factor": "fraction",
    "sliding_window": "size0", "attention_chunk_size": "count", "attention_bias": "flag",
    "tie_word_embeddings": "flag", "clip_qkv": "scale", "attn_config.clip_qkv": "scale",
    "final_logit_softcapping": "scale", "attn_logit_softcapping": "scale", "embedding_multiplier": "scale",
    "attention_multiplier": "scale", "residual_multiplier": "scale", "logits_scaling": "scale",
    "swiglu_limit": "scale",
    # token ids the sampler stops at or the embedding pads with (pad_token_id checked against vocab_size)
    "eos_token_id": "token", "bos_token_id": "token", "pad_token_id": "token",
    # activations and per-layer kinds: transformers looks each up in its own tables (checked by building the
    # model when quantizing, smoe.hf.model.check_buildable)
    "hidden_act": "name", "hidden_activation": "name", "mlp_hidden_act": "name", "layer_types": "names",
    "layers_block_type": "names", "mlp_layer_types": "names",
}
# null means "none" or "derive it" for these (no low-rank q or kv, no window, head_dim = hidden / heads)
NULLABLE = frozenset({
    "q_lora_rank", "kv_lora_rank", "sliding_window", "head_dim", "global_head_dim", "moe_latent_size",
    "attention_chunk_size", "clip_qkv", "attn_config.clip_qkv", "final_logit_softcapping", "attn_logit_softcapping",
    "moe_layer_end_index", "num_global_key_value_heads", *CONFIG_KEYS["mtp_layers"],
    # null where the family's configuration class accepts it: no group routing, LayerNorm instead of RMSNorm
    "n_group", "topk_group", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps",
    "eos_token_id", "bos_token_id", "pad_token_id", "hidden_act", "layer_types", "mlp_layer_types",
})
PER_LAYER = frozenset({"moe_topk", "num_experts", "moe_intermediate_size", "num_shared_expert"})  # hunyuan: lists
ROPE_DICTS = ("rope_parameters", "rope_scaling")  # each may hold one dict per attention type (gemma)
ROPE_VALUES = {
    "rope_theta": "base", "factor": "scale", "original_max_position_embeddings": "count",
    "beta_fast": "scale", "beta_slow": "scale", "mscale": "real", "mscale_all_dim": "real",
    "attention_factor": "scale", "low_freq_factor": "scale", "high_freq_factor": "scale",
    "partial_rotary_factor": "fraction", "short_factor": "factors", "long_factor": "factors",
    "llama_4_scaling_beta": "real", "rope_type": "name",
}
ROPE_REQUIRED = frozenset({"rope_theta", "factor"})  # the other rope values may be null (unused)
# routers that score an expert group by its two best experts (torch.topk(2) within the group)
GROUP_TOP2 = frozenset({"deepseek_v3", "glm4_moe", "dots1", "exaone_moe", "nemotron_h", "mistral4"})
_ABSENT = object()


def check_model_config(config: dict, num_experts: int | None = None, where: str = "config.json") -> None:
    """Every routing and shape value the runtime uses, by each family's key names: a SmoeError naming
    the first bad one. num_experts: the routed experts actually stored, where known."""
    if not isinstance(config, dict):
        return
    family, _, configs = _resolve(config)
    _check_config(config, configs, family.name if family else None, num_experts, where)


def _check_config(config: dict, configs: list[dict], family: str | None, num_experts: int | None, where: str) -> None:
    problem = _bad_value(config)
    get = lambda *keys: _lookup(configs, keys)
    for relation in (_top_k_fits, _groups_fit, _heads_fit, _attention_fits, _layer_numbers_fit, _tokens_fit):
        problem = problem or relation(get, family, num_experts)
    if problem:
        raise SmoeError(f"{where}: {problem}")


def _bad_value(config: dict) -> str | None:
    """The first value not of its key's kind, in the config and the text configs nested in it."""
    scopes = [("", config)] + [(f"{k}.", config[k]) for k in NESTED_CONFIGS if isinstance(config.get(k), dict)]
    for prefix, scope in scopes:
        for key, value, kind, nullable in _values(scope):
            test, words = _KINDS[kind]
            if isinstance(value, list) and key in PER_LAYER and value and all(test(v) for v in value):
                continue
            if not (test(value) or (value is None and nullable)):
                return f"{prefix}{key} is {_show(value)}; it must be {words}" + (" or null" if nullable else "")
    return None


def _values(scope: dict):
    """(key, value, kind, nullable) of every checked key present in one config dict."""
    for key, kind in CONFIG_VALUES.items():
        value = _get(scope, key)
        if value is not _ABSENT:
            yield key, value, kind, key in NULLABLE
    for name in ROPE_DICTS:
        rope = scope.get(name)
        if not isinstance(rope, dict):
            continue
        for prefix, table in [(name, rope)] + [(f"{name}.{k}", v) for k, v in rope.items() if isinstance(v, dict)]:
            for key, kind in ROPE_VALUES.items():
                if key in table:
                    yield f"{prefix}.{key}", table[key], kind, key not in ROPE_REQUIRED


def _get(scope: dict, key: str):
    value = scope
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def check_vault_config(config: dict, meta: dict, vault_dir) -> None:
    """What every reader of a vault checks before using it: config.json's values, and the index against them."""
    check_model_config(config, meta["num_experts"], f"{vault_dir}/config.json")
    check_index_agrees(config, meta, f"{vault_dir}/index.json")


def check_index_agrees(config: dict, meta: dict, where: str = "index.json") -> None:
    """The vault index's model type, roles, experts, top-k, MoE layers and expert shapes are those config.json
    gives (a reader sizes blobs by the index and the model by the config): a SmoeError naming the first
    index field that differs. Values the config leaves out are not compared."""
    family, model_type, configs = _resolve(config or {})
    if family is None:
        return
    problem = next(filter(None, (check(meta, family, str(model_type), configs) for check in _INDEX_AGREES)), None)
    if problem:
        raise SmoeError(f"{where}: {problem}")


def _index_names(meta, family, model_type, configs) -> str | None:
    if meta.get("model_type") not in (None, model_type):
        return f"model_type is {_show(meta['model_type'])}; config.json's is {_show(model_type)}"
    if meta["roles"] != list(family.roles):
        return f"roles are {_show(meta['roles'])}; {family.name} experts have {_show(list(family.roles))}"
    return None


def _index_counts(meta, family, model_type, configs) -> str | None:
    for name, keys in (("num_experts", CONFIG_KEYS["num_experts"]), ("top_k", CONFIG_KEYS["top_k"])):
        value = _lookup(configs, keys)
        if _is_int(value) and meta.get(name) != value:
            return f"{name} is {_show(meta.get(name))}; config.json says {value}"
    return None


def _index_layers(meta, family, model_type, configs) -> str | None:
    n = _num_layers(configs)
    if n is None or any(layout.marker for layout in family.layouts):
        return None  # MoE blocks told apart only by names (moondream): the names decided
    mtp = int(_lookup(configs, CONFIG_KEYS["mtp_layers"]) or 0)
    promised, stored = set(_config_moe_layers(configs, n)), set(meta["moe_layers"])
    odd = sorted((promised - stored) | {layer for layer in stored - promised if not n <= layer < n + mtp})
    if odd:
        return f"moe_layers {_ranges(sorted(stored))} differ from config.json's MoE layers at layer {odd[0]}"
    return None


def _index_shapes(meta, family, model_type, configs) -> str | None:
    inner = _lookup(configs, family.intermediate_keys)
    hidden = _lookup(configs, CONFIG_KEYS["hidden_size"])
    outer = _lookup(configs, _latent_keys(family)) or hidden
    if not (_is_int(inner) and _is_int(outer)):
        return None  # per-layer widths, or no widths in the config: the checkpoint's shapes decided
    shapes = {"gate": [inner, outer], "up": [inner, outer], "down": [outer, inner]}
    for role, shape in meta["expert_shapes"].items():
        if shape != shapes[role]:
            return f"expert_shapes[{role!r}] is {shape}; config.json's sizes make it {shapes[role]} ([out, in])"
    return None


_INDEX_AGREES = (_index_names, _index_counts, _index_layers, _index_shapes)


def show_value(value) -> str:
    return _show(value)


def _show(value) -> str:
    """A config value as config.json spells it (true, null, NaN, "4"), cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _smallest(value):
    return min(value) if isinstance(value, list) else value


def _top_k_fits(get, family, num_experts) -> str | None:
    counts = [_smallest(c) for c in (num_experts, get(*CONFIG_KEYS["num_experts"])) if c is not None]
    if not counts:
        return None
    experts = min(counts)
    for key in CONFIG_KEYS["top_k"]:
        k = get(key)
        if k is not None and max(k if isinstance(k, list) else [k]) > experts:
            return f"{key} is {_show(k)}: more than the {experts} routed experts"
    return None


def _groups_fit(get, family, num_experts) -> str | None:
    """DeepSeek-style routing: keep topk_group of n_group expert groups, then pick top-k experts in them."""
    groups, kept = get("n_group"), get("topk_group")
    experts = num_experts or _smallest(get(*CONFIG_KEYS["num_experts"]))
    if groups is None or experts is None:
        return None
    top_k = _smallest(get(*CONFIG_KEYS["top_k"]))
    per_group = experts // groups
    if experts % groups:
        return f"n_group {groups} does not divide the {experts} routed experts into equal groups"
    if kept is not None and kept > groups:
        return f"topk_group is {kept}: more than n_group {groups}"
    if kept is not None and top_k is not None and kept * per_group < top_k:
        return f"topk_group {kept} of {groups} groups keeps {kept * per_group} experts, fewer than the {top_k} to pick"
    if family in GROUP_TOP2 and per_group < 2:
        return f"n_group {groups} leaves {per_group} expert per group; {family} scores each group by its best two"
    return None


def _heads_fit(get, family, num_experts) -> str | None:
    heads, hidden = get("num_attention_heads", "n_heads"), get(*CONFIG_KEYS["hidden_size"])
    for key in ("num_key_value_heads", "attn_config.kv_n_heads", "num_global_key_value_heads"):
        kv = get(key)
        if heads is not None and kv is not None and heads % kv:
            return f"num_attention_heads {heads} is not a multiple of {key} {kv}"
    key_heads, value_heads = get("linear_num_key_heads"), get("linear_num_value_heads")
    if key_heads is not None and value_heads is not None and value_heads % key_heads:
        return f"linear_num_value_heads {value_heads} is not a multiple of linear_num_key_heads {key_heads}"
    # MLA families map head_dim to qk_rope_head_dim; transformers derives hidden // heads (glm4_moe's default: 42)
    derived = get("head_dim", "qk_rope_head_dim") is None and heads is not None and hidden is not None
    if derived and (hidden // heads < 2 or hidden // heads % 2):
        return (f"no head_dim, and hidden size {hidden} over {heads} heads is not an even head size "
                f"(head_dim = hidden size // num_attention_heads)")
    return None


def _attention_fits(get, family, num_experts) -> str | None:
    """A window of 0 means none only where use_sliding_window says so (qwen2 writes it so); elsewhere
    transformers masks every key. MLA (a kv_lora_rank) needs rotary and value heads in the families of
    the table (DeepSeek's modules fail without); a family transformers adds (GLM-5-Next's rotary-free
    latent attention) is left to its own configuration class's validators."""
    if get("sliding_window") == 0 and get("use_sliding_window") is not False:
        return "sliding_window is 0, a window that holds no token (give null for none)"
    rotary_mla = family in _BY_NAME
    if get("kv_lora_rank") is not None and 0 in (get("qk_rope_head_dim") if rotary_mla else 1, get("v_head_dim")):
        return (f"kv_lora_rank {get('kv_lora_rank')} (MLA attention) needs a positive qk_rope_head_dim and v_head_dim, "
                f"got {get('qk_rope_head_dim')} and {get('v_head_dim')}")
    return None


def _layer_numbers_fit(get, family, num_experts) -> str | None:
    n = get(*CONFIG_KEYS["num_layers"])
    for key in ("mlp_only_layers", "moe_layers"):
        beyond = [i for i in get(key) or [] if n is not None and i >= n]
        if beyond:
            return f"{key} names layer {beyond[0]}, beyond the {n} layers"
    period, offset = get("expert_layer_period"), get("expert_layer_offset")
    if period is not None and offset is not None and offset >= period:
        return f"expert_layer_offset {offset} is not below expert_layer_period {period}"
    return None


def _tokens_fit(get, family, num_experts) -> str | None:
    """The padding token is a row of the embedding (an end-of-text id past the vocabulary is never sampled:
    harmless, and tiny test models keep their family's)."""
    vocab, pad = get("vocab_size"), get("pad_token_id")
    if _is_int(vocab) and _is_int(pad) and pad >= vocab:
        return f"pad_token_id is {pad}: past the vocabulary of {vocab} (the embedding's padding row)"
    return None


# ----- matching names ----------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^(?P<prefix>(?:.*?\.)?)(?:layers|blocks)\.(?P<layer>\d+)\.(?P<rest>.+)$")
_NUMBER_RE = re.compile(r"(?<=\.)\d+(?=\.)")
_MTP_RE = re.compile(r"(^|\.)mtp\.$")


@dataclass(frozen=True)
class _Entry:
    """What a layer-relative name template means in one family."""

    layout: int  # index into the family's layouts
    role: str
    stored: Stored
    bias: bool


def _templates(family: Family) -> dict[str, list[_Entry]]:
    table: dict[str, list[_Entry]] = {}
    for i, layout in enumerate(family.layouts):
        for bias, stored_map in ((False, layout.roles), (True, layout.biases)):
            for role, stored in stored_map.items():
                table.setdefault(stored.template, []).append(_Entry(i, role, stored, bias))
    return table


@dataclass(frozen=True)
class _Name:
    """A tensor name split at its decoder layer, its expert number (if any) replaced by {e}."""

    name: str
    prefix: str
    layer: int
    template: str
    expert: int | None
    layer_base: str  # the name up to and including "layers.<L>."


def _parse(names: list[str]) -> list[_Name]:
    parsed = []
    for name in names:
        m = _LAYER_RE.match(name)
        if not m:
            continue
        rest = "." + m["rest"] + "."
        numbers = _NUMBER_RE.findall(rest)
        if len(numbers) > 1:
            continue
        template = _NUMBER_RE.sub("{e}", rest, count=1)[1:-1]
        expert = int(numbers[0]) if numbers else None
        parsed.append(_Name(name, m["prefix"], int(m["layer"]), template, expert, name[: m.start("rest")]))
    return parsed


@dataclass
class _Hit:
    name: str
    prefix: str
    layer: int
    expert: int | None  # None: the tensor holds every expert
    entry: _Entry


def _match(family: Family, parsed: list[_Name], present: set[str]) -> list[_Hit]:
    table = _templates(family)
    layouts = family.layouts
    hits = []
    for p in parsed:
        for entry in table.get(p.template, ()):
            marker = layouts[entry.layout].marker
            if marker and p.layer_base + marker not in present:
                continue
            hits.append(_Hit(p.name, p.prefix, p.layer, p.expert, entry))
    return hits


def _infer_family(names: list[str], parsed: list[_Name]) -> Family:
    """No config: the family whose layouts match the names (families sharing a naming agree)."""
    present = set(names)
    found = {f.name: frozenset(h.name for h in _match(f, parsed, present)) for f in FAMILIES}
    matches = [f for f in FAMILIES if found[f.name]]
    if not matches:
        raise SmoeError("no config.json model_type, and no routed-expert tensors recognised in the tensor names "
                        f"(supported families: {', '.join(supported_families())})")
    if len({found[f.name] for f in matches}) > 1:
        raise SmoeError(f"no config.json model_type, and the tensor names fit several families differently "
                        f"({', '.join(f.name for f in matches)}): add a config.json")
    hinted = [f for f in matches if f.hint and any(f.hint in n for n in names)]
    return (hinted or matches)[0]


# ----- planning ----------------------------------------------------------------------------------


def map_experts(config: dict, names: list[str], num_experts: int | None = None) -> ExpertMap:
    """Find every routed expert's projections; count them against the config (see module docstring).

    num_experts: the number of routed experts, overriding the config (needed where experts are
    fused and the config does not say).
    """
    names = sorted(names)
    family, model_type, configs = _resolve(config or {})
    parsed = _parse(names)
    if family is None:
        family = _infer_family(names, parsed)
        model_type = family.name
    _check_config(config or {}, configs, family.name, num_experts, "config.json")
    hits = _match(family, parsed, set(names))
    if not hits:
        raise SmoeError(f"{model_type}: no routed-expert tensors found; expected "
                        f"{'; or '.join(layout.what for layout in family.layouts)}")
    hits, mtp_names = _decoder_hits(hits)
    e_count = _expert_count(model_type, configs, hits, num_experts, family)
    hits, identity_names = _without_identity_experts(hits, e_count, _int(_lookup(configs, (family.identity_key,)))
                                                     if family.identity_key else 0)
    moe_layers = _expected_layers(configs, _num_layers(configs), hits, family)

    experts, biases, found = _collect(hits, e_count)
    _check_counts(model_type, moe_layers, e_count, family.roles, experts, found)
    _check_biases(model_type, biases, experts)
    keys = [(layer, e) for layer in moe_layers for e in range(e_count)]

    expert_names = {h.name for h in hits} | mtp_names | identity_names
    owners = {_owner(n) for n in expert_names}
    # parts a format leaves beside a projection (input scales, ...) belong to the expert, not the trunk
    expert_names |= {n for n in names if _owner(n) in owners}

    hidden = _int(_lookup(configs, CONFIG_KEYS["hidden_size"]))
    top_k = _int(_lookup(configs, CONFIG_KEYS["top_k"]))
    return ExpertMap(
        family=family.name,
        model_type=str(model_type),
        moe_layers=moe_layers,
        num_experts=e_count,
        top_k=top_k,
        roles=family.roles,
        experts={k: [experts[k][r] for r in family.roles] for k in keys},
        biases={k: [biases[k][r] for r in family.roles if r in biases[k]] for k in keys if k in biases},
        expert_names=expert_names,
        hidden_size=hidden,
        expert_intermediate_size=_int(_lookup(configs, family.intermediate_keys)),
        expert_input_size=_int(_lookup(configs, _latent_keys(family))) or hidden,
    )


def _latent_keys(family: Family) -> tuple[str, ...]:
    """Config keys of the width a family's experts take in where it is not the hidden size (Nemotron-H's
    moe_latent_size; Muse Spark's moe_hidden_size, its discovered row says)."""
    return (*family.latent_keys, *CONFIG_KEYS["latent_size"])


def describe_config(config: dict, num_experts: int | None = None) -> ExpertMap:
    """The MoE geometry a config promises, without tensor names (`smoe inspect` of a bare config):
    a plan with no expert sources."""
    family, model_type, configs = _resolve(config or {})
    if family is None:
        raise SmoeError("config has no model_type: cannot tell the model family")
    count = num_experts if num_experts is not None else _int(_lookup(configs, CONFIG_KEYS["num_experts"]))
    n_layers = _num_layers(configs)
    if not count or n_layers is None:
        raise SmoeError(f"{model_type}: the config does not give the number of experts and layers "
                        f"(pass --num-experts, or inspect a directory with the weight index)")
    hidden = _int(_lookup(configs, CONFIG_KEYS["hidden_size"]))
    return ExpertMap(
        family=family.name, model_type=str(model_type), moe_layers=_config_moe_layers(configs, n_layers),
        num_experts=count, top_k=_int(_lookup(configs, CONFIG_KEYS["top_k"])), roles=family.roles,
        experts={}, biases={}, expert_names=set(), hidden_size=hidden,
        expert_intermediate_size=_int(_lookup(configs, family.intermediate_keys)),
        expert_input_size=_int(_lookup(configs, _latent_keys(family))) or hidden,
    )


def _int(value) -> int | None:
    """A config number; per-layer lists (hunyuan's moe_topk) give their largest."""
    if isinstance(value, list):
        value = max(value) if value else None
    return int(value) if value is not None else None


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _decoder_hits(hits: list[_Hit]) -> tuple[list[_Hit], set[str]]:
    """The decoder's experts, and the names of experts in separate multi-token-prediction modules.

    Expert-shaped names under another prefix (a vision or audio tower) are not the decoder's: they
    stay in the trunk.  Experts under an mtp.* prefix (qwen3-next, qwen3.5) belong to a module that
    inference does not run: they are neither counted nor kept in the trunk.
    """
    counts: dict[str, int] = {}
    for h in hits:
        if not _MTP_RE.search(h.prefix):
            counts[h.prefix] = counts.get(h.prefix, 0) + 1
    if not counts:
        raise SmoeError("routed experts found only in multi-token-prediction layers")
    decoder = max(counts, key=counts.get)
    mtp = {h.name for h in hits if _MTP_RE.search(h.prefix)}
    return [h for h in hits if h.prefix == decoder], mtp


def _without_identity_experts(hits: list[_Hit], e_count: int, identity: int | None) -> tuple[list[_Hit], set[str]]:
    """The hits of the routed experts, and the names of tensors kept for identity experts (LongCat's "zero"
    experts, numbered after the routed ones): an identity expert passes its token through, so what a
    checkpoint holds for one (transformers saves the rows its fused gate_up allots them, never read) is
    neither an expert nor trunk."""
    dead = {h.name for h in hits if h.expert is not None and e_count <= h.expert < e_count + (identity or 0)}
    return [h for h in hits if h.name not in dead], dead


def _expert_count(model_type: str, configs: list[dict], hits: list[_Hit], num_experts: int | None,
                  family: Family) -> int:
    count = num_experts if num_experts is not None else _int(_lookup(configs, CONFIG_KEYS["num_experts"]))
    if count is not None:
        if int(count) <= 0:
            raise SmoeError(f"{model_type}: {count} routed experts: not a mixture-of-experts model")
        return int(count)
    if any(h.expert is None for h in hits):
        raise SmoeError(f"{model_type}: experts are fused ({family.layouts[hits[0].entry.layout].what}) and "
                        f"the config does not say how many there are: pass the number of routed experts "
                        f"(--num-experts)")
    return max(h.expert for h in hits) + 1


def _expected_layers(configs: list[dict], n_layers: int | None, hits: list[_Hit], family: Family) -> list[int]:
    """The MoE layers the config promises, plus the MTP layers present; without a layer count: as found.

    DeepSeek-style checkpoints store their multi-token-prediction layers as decoder layers numbered
    after the last one (model.layers.61 of 61), routed experts and all: they count where present.
    """
    seen = sorted({h.layer for h in hits})
    if n_layers is None or any(layout.marker for layout in family.layouts):
        return seen  # no layer count, or MoE blocks told apart only by names (moondream)
    mtp_count = int(_lookup(configs, CONFIG_KEYS["mtp_layers"]) or 0)
    extra = [layer for layer in seen if n_layers <= layer < n_layers + mtp_count]
    return _config_moe_layers(configs, n_layers) + extra


def _collect(hits: list[_Hit], e_count: int):
    """(layer, expert) -> role -> source, for projections and biases; plus the (layer, expert) seen."""
    experts: dict[tuple[int, int], dict[str, ProjectionSource]] = {}
    biases: dict[tuple[int, int], dict[str, BiasSource]] = {}
    found: set[tuple[int, int]] = set()
    for h in hits:
        s, role = h.entry.stored, h.entry.role
        # a per-expert tensor is the expert's own; a fused or stacked one is indexed by expert
        for e in [h.expert] if h.expert is not None else range(e_count):
            index = None if h.expert is not None else e
            if h.entry.bias:
                src, target = BiasSource(role, h.name, index, s.part, s.parts, s.interleaved), biases
            else:
                src = ProjectionSource(role, h.name, index, s.transpose, s.part, s.parts, s.interleaved,
                                       e_count if s.stacked else 0)
                target = experts
                found.add((h.layer, e))
            sources = target.setdefault((h.layer, e), {})
            if sources.get(role, src) != src:
                raise SmoeError(f"layer {h.layer} expert {e} {role}: found in two tensors, "
                                f"{sources[role].name} and {h.name}")
            sources[role] = src
    return experts, biases, found


def _check_counts(model_type: str, moe_layers: list[int], e_count: int, roles: tuple[str, ...],
                  experts: dict, found: set) -> None:
    """Exactly moe_layers x e_count experts, each with every role, or a SmoeError saying what is off."""
    expected = {(layer, e) for layer in moe_layers for e in range(e_count)}
    missing = [f"layer {layer} expert {e} {role}" for layer, e in sorted(expected) for role in roles
               if role not in experts.get((layer, e), {})]
    unexpected = sorted(found - expected)
    if not missing and not unexpected:
        return
    promise = f"{len(moe_layers)} MoE layers x {e_count} experts"
    parts = []
    if missing:
        parts.append(f"{len(missing)} expert projections missing (first: {', '.join(missing[:5])})")
    if unexpected:
        extra_layers = sorted({layer for layer, _ in unexpected} - set(moe_layers))
        what = f"layers {_ranges(extra_layers)} that should have none" if extra_layers else (
            f"expert ids up to {max(e for _, e in unexpected)}")
        parts.append(f"{len(unexpected)} experts beyond that ({what})")
    raise SmoeError(f"{model_type}: expected {promise}, but the checkpoint has {'; '.join(parts)}")


def _check_biases(model_type: str, biases: dict, experts: dict) -> None:
    """Expert biases are all-or-nothing per role: a partial set means a damaged checkpoint."""
    for role in sorted({r for sources in biases.values() for r in sources}):
        lacking = [key for key in sorted(experts) if role not in biases.get(key, {})]
        if lacking:
            layer, e = lacking[0]
            raise SmoeError(f"{model_type}: {len(lacking)} experts lack their {role} bias "
                            f"(first: layer {layer} expert {e})")


def _ranges(values: list[int]) -> str:
    if not values:
        return "none"
    return f"{values[0]}..{values[-1]}" if len(values) > 2 else ", ".join(map(str, values))


# ----- loading -----------------------------------------------------------------------------------

# Formats whose dequantised tensors come [E, out, in] even where the bf16 release stores [E, in, out]:
# MXFP4 packs along the input dimension, so gpt-oss stores its MXFP4 experts untransposed.
_STORED_OUT_IN = {"mxfp4"}


def load_projection(ckpt, src: ProjectionSource, digest=None) -> torch.Tensor:
    """The projection as [out, in], contiguous, in the source dtype; `digest` is fed the bytes read."""
    ckpt.check_real_valued(src.name, "expert tensor")
    if src.stacked:
        t = _load_block(ckpt, src.name, src.expert_index, src.stacked, digest)
    else:
        t = ckpt.load(src.name, index=src.expert_index, digest=digest)
    if t.dim() != 2:
        raise SmoeError(f"{src.name}: expected a matrix for expert {src.expert_index} {src.role}, "
                        f"got shape {tuple(t.shape)}")
    if src.transpose and ckpt.source_format(src.name) not in _STORED_OUT_IN:
        t = t.t()
    return _take_part(t, src.name, src.part, src.parts, src.interleaved).contiguous()


def load_bias(ckpt, src: BiasSource, digest=None) -> torch.Tensor:
    """The bias as [out]; fp64 is rounded here to the fp32 a vault keeps biases in, where a value
    beyond fp32's range can still be named instead of being stored as inf."""
    ckpt.check_real_valued(src.name, "expert bias")
    t = ckpt.load(src.name, index=src.expert_index, digest=digest)
    if t.dim() != 1:
        raise SmoeError(f"{src.name}: expected a vector for expert {src.expert_index} {src.role} bias, "
                        f"got shape {tuple(t.shape)}")
    if t.dtype == torch.float64:
        wide, t = t, t.float()
        if bool(torch.isfinite(wide).all()) and not bool(torch.isfinite(t).all()):
            raise SmoeError(f"tensor {src.name}: fp64 bias values of expert {src.expert_index} beyond the fp32 range "
                            f"a vault keeps biases in")
    return _take_part(t, src.name, src.part, src.parts, src.interleaved).contiguous()


def _take_part(t: torch.Tensor, name: str, part: int, parts: int, interleaved: bool) -> torch.Tensor:
    if parts == 1:
        return t
    if t.shape[0] % parts:
        raise SmoeError(f"{name}: {t.shape[0]} rows do not split into {parts} equal parts")
    if interleaved:
        return t[part::parts]
    return t.chunk(parts, dim=0)[part]


def _load_block(ckpt, name: str, block: int, blocks: int, digest=None) -> torch.Tensor:
    """Rows block*R:(block+1)*R of a 2-D [blocks*R, C] tensor, read one row at a time so that only
    that expert's bytes are read (a whole DBRX w1 is 2 GB)."""
    shape = ckpt.shape(name)
    if shape is None or len(shape) != 2 or shape[0] % blocks:
        raise SmoeError(f"{name}: shape {shape} does not stack {blocks} experts along dim 0")
    rows = shape[0] // blocks
    return torch.stack([ckpt.load(name, index=block * rows + r, digest=digest) for r in range(rows)])
