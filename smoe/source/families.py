"""Model families: one row per family, saying where its routed experts are stored.

A family is a row of FAMILIES: the model_types it answers to, the on-disk layouts its routed experts may
come in (`layouts`, built by smoe.source.layouts), and which config keys hold the expert intermediate size.
What the rows share sits beside this table, one job a module; together they are the only place that knows
tensor names and config keys:

* smoe.source.matching splits a tensor name into <prefix><layers|blocks>.<L>.<rest>; <rest> with its
  expert number replaced by "{e}" is looked up in the family's layouts (one dict lookup per name), so
  shared experts, dense MLPs, routers and vision towers simply never match; map_experts then counts:
  every MoE layer x every expert x every role, or a SmoeError;
* smoe.source.config_numbers reads how many experts, how many layers and which layers are MoE
  (CONFIG_KEYS and config_moe_layers); where the config does not say, the names say it;
* smoe.source.config_checks holds every routing and shape value the runtime reads to its kind and range
  (CONFIG_VALUES, and the relations between them), when quantising and when a vault is opened;
* smoe.source.loading reads one expert's projection or bias.
"""

from __future__ import annotations

from dataclasses import dataclass

from smoe.errors import SmoeError
from smoe.source.layouts import GATED, NON_GATED, Layout, Stored, fused_each, fused_gate_up, per_expert, standard

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
BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
BY_NAME = {f.name: f for f in FAMILIES}
_ALIASES = sorted(t for f in FAMILIES for t in f.model_types if t != f.name)


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


def normalise_type(model_type) -> str:
    return str(model_type or "").strip().lower().replace("-", "_")


def family_of(model_type: str, config: dict) -> Family:
    """The family of a config's model_type: its row, else a discoverer's; a SmoeError saying why there is none."""
    family = BY_TYPE.get(normalise_type(model_type)) or _discovered(config)
    if isinstance(family, str):
        raise SmoeError(f"unsupported model_type {model_type!r}: {family}")
    if family is None:
        raise SmoeError(f"unsupported model_type {model_type!r}; supported families: "
                        f"{', '.join(supported_families())} (aliases: {', '.join(sorted(_ALIASES))})")
    return family
