"""A memory plan per GPU for PPO under FSDP2: what each rank holds, from the model's config.

    .venv/bin/python -m benchmarks.memory_plan                      # 1.5B, 7B, 8B; 8 x 80 GB
    .venv/bin/python -m benchmarks.memory_plan --config path/to/model   # your model (config.json)
    .venv/bin/python -m benchmarks.memory_plan --from-yaml configs/gpu/fsdp2_7b.yaml
    .venv/bin/python -m benchmarks.memory_plan --check              # against the CPU measurements

Parameters are counted exactly: every role is built as the package builds it (the transformers
model from its config, ``ValueModel``, the shared head, PEFT's LoRA) on the meta device, and every
parameter is sharded along dim 0 as FSDP2 does (``torch.chunk``: rank 0 holds the most). The run
is lightning_ppo's under ``ModelParallelStrategy`` (data_parallel_size = ranks) and ``bf16-mixed``
(``lightning_ppo.distributed.sharding.mixed_precision_policy``): fp32 trained weights, gradients and AdamW
moments sharded; frozen roles sharded in ``frozen_dtype``; bf16 copies gathered for compute and
gradients reduced in fp32. Activations, the KV cache and vLLM's share are estimates, stated where
they are computed; docs/memory.md explains the method and its assumptions. Sizes are in GiB
(2**30 bytes), written GB as GPU vendors do.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

GiB = 2**30
MiB = 2**20
LAYOUTS = ("separate", "shared", "lora")
# Shapes from each model's config.json on the Hugging Face hub (only what sets parameter shapes).
MODELS: dict[str, dict[str, Any]] = {
    "Qwen2.5-1.5B": dict(
        model_type="qwen2", hidden_size=1536, num_hidden_layers=28, intermediate_size=8960,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    ),
    "Qwen2.5-7B": dict(
        model_type="qwen2", hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
    ),
    "Llama-3.1-8B": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    ),
}  # fmt: skip
# benchmarks/sharded_memory.py's model (benchmarks/roles_memory.py writes it): GPT-2 small's shape.
GPT2_SMALL = dict(model_type="gpt2", n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
# What benchmarks/sharded_memory.py measured, "sum of tensors" in MB per rank (docs/performance.md).
MEASURED_SUM_MB = {1: 4747, 2: 2374}
# Bytes per logit of the trained response tokens: bf16 logits (2), the fp32 copy that log-softmax
# keeps for its backward (4, functional.logprobs_from_logits), and its fp32 gradient (4).
TRAIN_LOGIT_BYTES = 10


@dataclass(frozen=True)
class Param:
    """One parameter as FSDP2 holds it: sharded along dim 0 (``rows``)."""

    rows: int
    numel: int
    itemsize: int  # bytes per element as stored (fp32 trained, ``frozen_dtype`` frozen)
    trained: bool

    def shard_bytes(self, ranks: int) -> int:
        """Rank 0's shard: ``torch.chunk`` gives it ceil(rows / ranks) rows, the most of any rank."""
        return math.ceil(self.rows / ranks) * (self.numel // self.rows) * self.itemsize

    def gathered_bytes(self, ranks: int, itemsize: int | None) -> int:
        """The all-gathered whole (padded to ranks equal shards) in the compute dtype's ``itemsize``."""
        return math.ceil(self.rows / ranks) * ranks * (self.numel // self.rows) * (itemsize or self.itemsize)


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit: a transformer block, or a role's root (every parameter no block holds)."""

    params: tuple[Param, ...]

    def gathered(self, ranks: int, itemsize: int | None) -> int:
        return sum(p.gathered_bytes(ranks, itemsize) for p in self.params)

    def gathered_grads(self, ranks: int, itemsize: int | None) -> int:
        """Its trained parameters' unsharded gradients (compute dtype, the weights' shapes) and their
        fp32 reduce-scatter input (FSDP2 copies them into one padded ``reduce_dtype`` buffer)."""
        trained = [p for p in self.params if p.trained]
        return sum(p.numel * (itemsize or p.itemsize) + p.gathered_bytes(ranks, 4) for p in trained)


@dataclass(frozen=True)
class Shape:
    """What activations and the KV cache scale with, from a Hugging Face config."""

    layers: int
    hidden: int
    intermediate: int
    kv_dim: int  # key/value heads x head dim
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Shape:
        hidden = config.hidden_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        return cls(
            config.num_hidden_layers,
            hidden,
            intermediate or 4 * hidden,
            kv_heads * head_dim,
            config.vocab_size,
        )


@dataclass(frozen=True)
class Role:
    """One role model as the FSDP2 plan shards it (``lightning_ppo.distributed.sharding.shard_model``)."""

    name: str
    root: Unit
    blocks: tuple[Unit, ...]
    shape: Shape | None  # None: a head without a backbone (the shared value head)

    @property
    def units(self) -> tuple[Unit, ...]:
        return (self.root, *self.blocks)

    @property
    def params(self) -> list[Param]:
        return [p for unit in self.units for p in unit.params]

    @property
    def trains(self) -> bool:
        return any(p.trained for p in self.params)


@dataclass(frozen=True)
class Settings:
    """The run, as lightning_ppo's config sets it (per GPU where it says so)."""

    ranks: int = 8  # ModelParallelStrategy's data_parallel_size
    gpu_gb: float = 80.0
    # Never planned for: the CUDA context, NCCL's buffers, the caching allocator's fragmentation.
    reserve_gb: float = 6.0
    precision: str = "bf16-mixed"  # or "32-true"
    # fp32: the master weights mixed precision wants, which lightning_ppo loads whatever dtype the
    # checkpoint was saved in (every hub LLM: bf16); see docs/memory.md.
    trained_dtype: str = "fp32"
    frozen_dtype: str | None = "bf16"  # model.frozen_dtype; None: as trained
    rollout_batch: int = 16  # sequences per GPU per iteration: data.batch_size x ppo.num_generations
    max_prompt: int = 512  # data.max_prompt_length
    max_new_tokens: int = 256
    num_minibatches: int = 4
    accumulation: int = 1  # ppo.gradient_accumulation_steps
    forward_chunk_size: int = 8  # generation.forward_chunk_size (0: the whole batch)
    gradient_checkpointing: bool = True
    gather_for_generation: bool = True
    gpu_memory_utilization: float = 0.3  # vLLM's share of the GPU, when generation.engine is vllm
    lora_r: int = 16
    lora_alpha: int = 32

    def __post_init__(self) -> None:
        if self.precision not in ("bf16-mixed", "32-true"):
            raise ValueError(f"precision must be bf16-mixed or 32-true, got {self.precision!r}")

    @property
    def compute_itemsize(self) -> int | None:
        """Bytes per gathered weight: bf16-mixed gathers every weight in bf16; 32-true as stored."""
        return 2 if self.precision == "bf16-mixed" else None

    @property
    def activation_bytes(self) -> int:
        return 2 if self.precision == "bf16-mixed" else 4

    @property
    def sequence(self) -> int:
        return self.max_prompt + self.max_new_tokens

    @property
    def micro_rows(self) -> int:
        """Sequences per forward/backward of the PPO update."""
        return math.ceil(self.rollout_batch / self.num_minibatches / self.accumulation)


@dataclass(frozen=True)
class Plan:
    """Bytes one rank holds (rank 0, whose shards are the largest), by component and by phase."""

    settings: Settings
    trained: int  # sharded trained weights
    frozen: int  # sharded frozen weights (reference, reward model, LoRA base)
    adamw_moments: int  # exp_avg and exp_avg_sq, sharded as their weights
    adamw_steps: int  # one step counter per trained tensor
    grads: int  # sharded gradients, from the backward to the step
    accumulated: int  # whole fp32 gradients FSDP2 keeps across accumulation micro-batches
    gathered_train: int  # trained roots whole + one block (and one prefetched), with their gradients
    activations: int  # the PPO update's forward/backward (estimate)
    gathered_generation: int  # the policy gathered for generate
    kv_cache: int  # the rollout batch's keys and values
    generation_work: int  # the prompt prefill's layer working set and last-token logits (estimate)
    rollout_forwards: int  # gathered roots and a block, logits and a layer's working set (estimate)
    vllm_share: int  # gpu_memory_utilization x GPU memory, weights and KV cache inside it
    vllm_weights: int  # the engine's bf16 copy of the policy

    @property
    def adamw(self) -> int:
        return self.adamw_moments + self.adamw_steps

    @property
    def resident(self) -> int:
        """Held through the whole iteration."""
        return self.trained + self.frozen + self.adamw

    @property
    def training(self) -> int:
        # Gradients and activations are added although the backward frees activations as it makes
        # gradients: an upper bound.
        extra = self.grads + self.accumulated + self.gathered_train + self.activations
        return self.resident + extra

    @property
    def generation(self) -> int:
        return self.resident + self.gathered_generation + self.kv_cache + self.generation_work

    @property
    def forwards(self) -> int:
        return self.resident + self.rollout_forwards

    @property
    def peak(self) -> int:
        """With Hugging Face generate (generation.engine hf)."""
        return max(self.training, self.generation, self.forwards)

    @property
    def vllm_peak(self) -> int:
        """With a colocated vLLM engine: it wakes while PyTorch's caching allocator still holds what
        the PPO update reserved (nothing empties that cache), so its share comes on top of training."""
        return max(self.training, self.forwards) + self.vllm_share

    @property
    def budget(self) -> int:
        return int((self.settings.gpu_gb - self.settings.reserve_gb) * GiB)


def plan_memory(roles: list[Role], settings: Settings) -> Plan:
    """What each rank holds for ``roles`` run under ``settings``: the accounting, no torch."""
    n, params = settings.ranks, [p for role in roles for p in role.params]
    trained = sum(p.shard_bytes(n) for p in params if p.trained)
    policy = next(role for role in roles if role.name == "policy")
    kv_cache = _kv_bytes(policy.shape, settings.rollout_batch * settings.sequence, settings)
    return Plan(
        settings=settings,
        trained=trained,
        frozen=sum(p.shard_bytes(n) for p in params if not p.trained),
        adamw_moments=2 * trained,
        adamw_steps=4 * sum(p.trained for p in params),  # fp32 scalars, not sharded
        grads=trained,
        accumulated=_accumulated(params, settings),
        gathered_train=_gathered_train(roles, settings),
        activations=_activations(roles, settings),
        gathered_generation=_gathered_generation(policy, settings),
        kv_cache=kv_cache,
        generation_work=_generation_work(policy.shape, settings),
        rollout_forwards=_rollout_forwards(roles, settings),
        vllm_share=int(settings.gpu_memory_utilization * settings.gpu_gb * GiB),
        vllm_weights=_vllm_weights(policy, settings),
    )


def _generation_work(shape: Shape, settings: Settings) -> int:
    """The prompts' prefill through one layer at a time, and generate's fp32 next-token logits."""
    prefill = _layer_forward_bytes(shape, settings.rollout_batch * settings.max_prompt, settings)
    return prefill + settings.rollout_batch * shape.vocab * 4


def _vllm_weights(policy: Role, settings: Settings) -> int:
    """vLLM loads the policy's checkpoint in the compute dtype; a LoRA policy is pushed merged, so
    its engine holds the base's shapes (the frozen parameters) and no adapters."""
    base = [p for p in policy.params if not p.trained] or policy.params
    return sum(p.numel for p in base) * settings.activation_bytes


def _accumulated(params: list[Param], settings: Settings) -> int:
    """FSDP2 without gradient sync (accumulation micro-batches) keeps every unsharded gradient, cast
    to the reduce dtype (fp32 under bf16-mixed; torch's ``FSDPParam.to_accumulated_grad_if_needed``),
    until the last micro-batch reduce-scatters it: the trained models' whole gradients on every rank."""
    if settings.accumulation == 1:
        return 0
    return sum(p.numel * (4 if settings.compute_itemsize else p.itemsize) for p in params if p.trained)


def _kv_bytes(shape: Shape, tokens: int, settings: Settings) -> int:
    """Keys and values of every layer for ``tokens`` positions."""
    return tokens * shape.layers * 2 * shape.kv_dim * settings.activation_bytes


def _layer_forward_bytes(shape: Shape, tokens: int, settings: Settings) -> int:
    """A decoder layer's live tensors in a forward without autograd: its input, the normed input,
    queries, keys and values, the attention output (SDPA/flash: no L x L scores), and the MLP's gate,
    up and activated tensors: 4 h + 2 kv + 3 i per token."""
    per_token = 4 * shape.hidden + 2 * shape.kv_dim + 3 * shape.intermediate
    return tokens * per_token * settings.activation_bytes


def _layer_saved_bytes(shape: Shape, tokens: int, settings: Settings) -> int:
    """What one decoder layer saves for its backward: two norms' inputs and outputs, q/k/v, the
    attention output, the MLP's gate, up, activation and product: 6 h + 2 kv + 4 i per token."""
    per_token = 6 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate
    return tokens * per_token * settings.activation_bytes


def _activations(roles: list[Role], settings: Settings) -> int:
    """The PPO update's micro-batch through every trained backbone, then backward.

    With gradient checkpointing each layer keeps only its input (tokens x hidden) and one layer at a
    time is recomputed: its saved tensors and their gradients. Without it every layer keeps its
    saved tensors. The policy's response logits add ``TRAIN_LOGIT_BYTES`` per logit.
    """
    rows, tokens = settings.micro_rows, settings.micro_rows * settings.sequence
    shapes = [role.shape for role in roles if role.trains and role.shape is not None]
    one_layer = max(_layer_saved_bytes(shape, tokens, settings) for shape in shapes)
    if settings.gradient_checkpointing:
        kept = sum(tokens * shape.hidden * settings.activation_bytes * shape.layers for shape in shapes)
    else:
        kept = sum(_layer_saved_bytes(shape, tokens, settings) * shape.layers for shape in shapes)
    policy = next(role for role in roles if role.name == "policy")
    logits = rows * (settings.max_new_tokens + 1) * policy.shape.vocab * TRAIN_LOGIT_BYTES
    return kept + 2 * one_layer + logits


def _gathered_train(roles: list[Role], settings: Settings) -> int:
    """FSDP2 keeps a root unit gathered from its forward through its backward (a root does not
    reshard after forward), so every trained role's root is whole at once, with its gradients. Of
    the blocks, one is computing its backward (weights and gradients) while the next is prefetched."""
    n, itemsize = settings.ranks, settings.compute_itemsize
    trained = [role for role in roles if role.trains]
    roots = sum(role.root.gathered(n, itemsize) + role.root.gathered_grads(n, itemsize) for role in trained)
    blocks = [block for role in trained for block in role.blocks]
    block = max((2 * b.gathered(n, itemsize) + b.gathered_grads(n, itemsize) for b in blocks), default=0)
    return roots + block


def _gathered_generation(policy: Role, settings: Settings) -> int:
    """gather_for_generation keeps every block whole through generate; off, the root and one block
    (and one prefetched) at a time."""
    n, itemsize = settings.ranks, settings.compute_itemsize
    if settings.gather_for_generation:
        return sum(unit.gathered(n, itemsize) for unit in policy.units)
    block = max((b.gathered(n, itemsize) for b in policy.blocks), default=0)
    return policy.root.gathered(n, itemsize) + 2 * block


def _rollout_forwards(roles: list[Role], settings: Settings) -> int:
    """No-grad forwards of every role over the rollout (the reward model's in ``score`` first).

    Every role's root stays gathered until ``sharding.reshard`` after the last forward; blocks come
    and go (one computing, one prefetched). Each forward runs ``forward_chunk_size`` rows (the reward
    model the whole batch); the policy's and the reference's response logits live together.
    """
    n, itemsize, s = settings.ranks, settings.compute_itemsize, settings
    roots = sum(role.root.gathered(n, itemsize) for role in roles)
    block = max((b.gathered(n, itemsize) for role in roles for b in role.blocks), default=0)
    chunk = min(s.forward_chunk_size or s.rollout_batch, s.rollout_batch)
    vocab = next(role for role in roles if role.name == "policy").shape.vocab
    logits = 2 * chunk * (s.max_new_tokens + 1) * vocab * s.activation_bytes
    work = max(
        _layer_forward_bytes(
            role.shape, (s.rollout_batch if role.name == "reward" else chunk) * s.sequence, s
        )
        for role in roles
        if role.shape is not None
    )
    return roots + 2 * block + logits + work


# ----------------------------------------------------------------- the roles, built for real on meta
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def model_config(model: str | dict[str, Any]) -> Any:
    """A Hugging Face config: a built-in model's (``MODELS``), shape keywords, or a config.json or a
    model folder on disk (read locally, never from the hub)."""
    from transformers import AutoConfig

    if isinstance(model, dict) or model in MODELS:
        kwargs = dict(MODELS[model] if isinstance(model, str) else model)
        return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    path = Path(model)
    if not path.exists():
        raise SystemExit(f"{model!r} is neither a built-in model ({', '.join(MODELS)}) nor a path")
    return AutoConfig.from_pretrained(path.parent if path.is_file() else path, local_files_only=True)


def describe(name: str, model: Any) -> Role:
    """``model``'s parameters in FSDP2 units, as ``sharding.shard_model`` makes them: a unit per
    transformer block (``_no_split_modules``), the rest in the root; one unit for a small model."""
    from transformers import PreTrainedModel

    from lightning_ppo.distributed.sharding import ONE_UNIT_BYTES, block_class_names

    unique = {id(p): p for p in model.parameters()}  # tied weights once, as FSDP2 holds them
    size = sum(p.numel() * p.element_size() for p in unique.values())
    names = block_class_names(model) if size > ONE_UNIT_BYTES else set()
    taken: set[int] = set()
    blocks = []
    for module in model.modules():
        if module is not model and type(module).__name__ in names:
            own = [p for p in module.parameters() if id(p) not in taken]
            taken.update(id(p) for p in own)
            blocks.append(Unit(tuple(_param(p) for p in own)))
    root = Unit(tuple(_param(p) for key, p in unique.items() if key not in taken))
    config = next((m.config for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    return Role(name, root, tuple(blocks), Shape.of(config) if config is not None else None)


def _param(tensor: Any) -> Param:
    rows = tensor.shape[0] if tensor.dim() else 1
    return Param(rows, tensor.numel(), tensor.element_size(), tensor.requires_grad)


def build_roles(policy_config: Any, reward_config: Any | None, layout: str, settings: Settings) -> list[Role]:
    """The roles of ``layout`` as ``lightning_ppo.models.roles.Roles`` and the reward model build them, on
    the meta device: no weights are allocated. The reward model defaults to the policy's shape."""
    import copy

    import torch
    from torch import nn
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    from lightning_ppo.models.loading import ValueModel, freeze
    from lightning_ppo.models.roles import LoraSettings, apply_lora

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    trained = getattr(torch, DTYPE_NAMES[settings.trained_dtype])
    frozen = getattr(torch, DTYPE_NAMES[settings.frozen_dtype or settings.trained_dtype])
    reward_config = copy.deepcopy(reward_config or policy_config)
    reward_config.num_labels = 1
    # The critic starts from the reward model when it reads the policy's tokens (InstructGPT, TRL).
    same_tokens = reward_config.vocab_size == policy_config.vocab_size
    critic_config = reward_config if same_tokens else policy_config
    with torch.device("meta"):
        if layout == "lora":  # one frozen base: policy with adapters, reference with them disabled
            base = AutoModelForCausalLM.from_config(policy_config, dtype=frozen)
            roles = [describe("policy", apply_lora(base, LoraSettings(settings.lora_r, settings.lora_alpha)))]
        else:
            reference = freeze(AutoModelForCausalLM.from_config(policy_config, dtype=frozen))
            policy = AutoModelForCausalLM.from_config(policy_config, dtype=trained)
            roles = [describe("policy", policy), describe("reference", reference)]
        if layout == "separate":
            critic = ValueModel(AutoModel.from_config(critic_config, dtype=trained))
            roles.append(describe("critic", critic))
        else:
            roles.append(describe("value head", nn.Linear(policy_config.hidden_size, 1)))
        reward = freeze(AutoModelForSequenceClassification.from_config(reward_config, dtype=frozen))
        roles.append(describe("reward", reward))
    return roles


# ----------------------------------------------------------------- reports
COLUMNS = {
    "trained": lambda p: p.trained,
    "frozen": lambda p: p.frozen,
    "AdamW": lambda p: p.adamw,
    "grads": lambda p: p.grads,
    "accum. grads": lambda p: p.accumulated,
    "gathered (update)": lambda p: p.gathered_train,
    "activations": lambda p: p.activations,
    "policy gathered (generate)": lambda p: p.gathered_generation,
    "KV cache": lambda p: p.kv_cache,
    "rollout forwards": lambda p: p.rollout_forwards,
    "update": lambda p: p.training,
    "generate": lambda p: p.generation,
}


def gb(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f}"


def plan_model(
    policy: str | dict[str, Any],
    settings: Settings,
    layouts: tuple[str, ...] = LAYOUTS,
    reward: str | None = None,
) -> dict[str, Plan]:
    """The plan of each layout for one policy (and reward model, default: the policy's shape)."""
    policy_config = model_config(policy)
    reward_config = model_config(reward) if reward else None
    return {
        layout: plan_memory(build_roles(policy_config, reward_config, layout, settings), settings)
        for layout in layouts
    }


def markdown_table(plans: dict[str, Plan]) -> str:
    """One row per layout: each component and each phase in GB per rank, the peak against the GPU."""
    budget = next(iter(plans.values())).budget
    head = ["layout", *COLUMNS, "peak", f"fits ({gb(budget)})", "vLLM share", "peak with vLLM", "fits"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for layout, plan in plans.items():
        cells = [gb(column(plan)) for column in COLUMNS.values()]
        fits = ["yes" if peak <= budget else "no" for peak in (plan.peak, plan.vllm_peak)]
        row = [
            layout,
            *cells,
            f"**{gb(plan.peak)}**",
            fits[0],
            gb(plan.vllm_share),
            gb(plan.vllm_peak),
            fits[1],
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def vllm_notes(plans: dict[str, Plan]) -> list[str]:
    """Whether vLLM's share holds its weights and the rollout batch's KV cache (one line per
    distinct answer: the layouts' engines usually hold the same policy shape)."""
    notes: dict[str, list[str]] = {}
    for layout, plan in plans.items():
        room = plan.vllm_share - plan.vllm_weights
        verdict = "holds" if room >= plan.kv_cache else "does not hold (vLLM preempts and recomputes)"
        note = (
            f"vLLM's {gb(plan.vllm_share)} GB share = {gb(plan.vllm_weights)} GB weights + {gb(room)} GB "
            f"for KV blocks, which {verdict} the rollout batch's {gb(plan.kv_cache)} GB"
        )
        notes.setdefault(note, []).append(layout)
    return [f"- {', '.join(layouts)}: {note}" for note, layouts in notes.items()]


def cross_check() -> list[tuple[int, float, int]]:
    """(ranks, planned MB, measured MB) of benchmarks/sharded_memory.py's "sum of tensors": GPT-2
    small in the separate layout, fp32, one process and FSDP2 over 2 ranks; like the benchmark,
    parameters + one gradient per trained parameter + AdamW's moments (not its step scalars)."""
    rows = []
    for ranks, measured in MEASURED_SUM_MB.items():
        settings = Settings(ranks=ranks, precision="32-true", frozen_dtype=None)
        plan = plan_model(GPT2_SMALL, settings, ("separate",))["separate"]
        total = plan.trained + plan.frozen + plan.grads + plan.adamw_moments
        rows.append((ranks, total / MiB, measured))
    return rows


def resolve_model(name: str) -> str:
    """The built-in model a hub id names (``Qwen/Qwen2.5-7B-Instruct``: Qwen2.5-7B), else ``name``."""
    return next((key for key in MODELS if key in name), name)


def settings_from_yaml(path: str | Path) -> tuple[Settings, str, str]:
    """The settings, layout and policy of a lightning_ppo config file; what it leaves unset takes the
    package's defaults (its config dataclasses and ``PromptDataModule``'s signature)."""
    import inspect

    import yaml

    from lightning_ppo import GenerationConfig, PPOConfig, PromptDataModule
    from lightning_ppo.models.roles import LoraSettings

    config = yaml.safe_load(Path(path).read_text())
    trainer, model = config.get("trainer", {}), config["model"].get("init_args", {})
    ppo, generation = PPOConfig(**model.get("ppo", {})), GenerationConfig(**model.get("generation", {}))
    signature = inspect.signature(PromptDataModule.__init__).parameters
    data = {name: p.default for name, p in signature.items()} | config.get("data", {}).get("init_args", {})
    strategy = trainer.get("strategy", {})
    ranks = strategy.get("init_args", {}).get("data_parallel_size") if isinstance(strategy, dict) else None
    lora = LoraSettings(**model["lora"]) if model.get("lora") else LoraSettings()
    settings = Settings(
        ranks=ranks or trainer.get("devices", 1),
        precision=str(trainer.get("precision", "32-true")),
        frozen_dtype=model.get("frozen_dtype"),
        rollout_batch=data["batch_size"] * ppo.num_generations,
        max_prompt=data["max_prompt_length"],
        max_new_tokens=generation.max_new_tokens,
        num_minibatches=ppo.num_minibatches,
        accumulation=ppo.gradient_accumulation_steps,
        forward_chunk_size=generation.forward_chunk_size,
        gradient_checkpointing=model.get("gradient_checkpointing", False),
        gather_for_generation=generation.gather_for_generation,
        gpu_memory_utilization=generation.gpu_memory_utilization,
        lora_r=lora.r,
        lora_alpha=lora.alpha,
    )
    layout = "lora" if model.get("lora") else model.get("value_model", "separate")
    return settings, layout, resolve_model(model["policy"])


def role_sizes(policy: str | dict[str, Any], settings: Settings, layout: str, reward: str | None) -> str:
    """The roles and their parameter counts, e.g. ``policy 7.62B, reference 7.62B, ...``."""
    reward_config = model_config(reward) if reward else None
    roles = build_roles(model_config(policy), reward_config, layout, settings)
    counts = {role.name: sum(p.numel for p in role.params) for role in roles}
    trained = {role.name: sum(p.numel for p in role.params if p.trained) for role in roles}
    return ", ".join(
        f"{name} {_count(count)}"
        + (f" ({_count(trained[name])} trained)" if 0 < trained[name] < count else "")
        for name, count in counts.items()
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else str(n)


def describe_settings(s: Settings) -> str:
    """The settings in a sentence, for the report's head."""
    return (
        f"Per rank, in GB (GiB): {s.ranks} ranks x {s.gpu_gb:g} GB ({s.gpu_gb - s.reserve_gb:g} planned as "
        f"usable), {s.precision}, trained weights {s.trained_dtype}, "
        f"frozen {s.frozen_dtype or s.trained_dtype}; "
        f"per GPU {s.rollout_batch} sequences of {s.max_prompt} + {s.max_new_tokens} tokens, "
        f"{s.num_minibatches} minibatches, gradient accumulation {s.accumulation}, forward chunk "
        f"{s.forward_chunk_size}, gradient checkpointing {s.gradient_checkpointing}, gather_for_generation "
        f"{s.gather_for_generation}, vLLM gpu_memory_utilization {s.gpu_memory_utilization}, "
        f"LoRA r {s.lora_r}."
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", nargs="+", help="your policy's config.json or folder (default: built-ins)"
    )
    parser.add_argument(
        "--reward-config", help="the reward model's config.json or folder (default: the policy's)"
    )
    parser.add_argument("--from-yaml", help="the settings, layout and policy of a lightning_ppo config file")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS)
    parser.add_argument("--check", action="store_true", help="against benchmarks/sharded_memory.py's figures")
    defaults = Settings()
    for name, value in vars(defaults).items():  # every setting, as --ranks, --gpu-gb, --max-new-tokens ...
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(
                flag, type=lambda v: v.lower() in ("1", "true", "yes"), help=f"default {value}"
            )
        else:
            kind = str if value is None else type(value)
            parser.add_argument(flag, type=kind, help=f"default {value}")
    return parser.parse_args()


def main() -> None:
    ns = parse_args()
    if ns.check:
        print("| ranks | planned sum of tensors (MB/rank) | measured (MB/rank, docs/performance.md) |")
        print("| --- | --- | --- |")
        for ranks, planned, measured in cross_check():
            print(f"| {ranks} | {planned:.1f} | {measured} |")
        return
    settings, layouts, models = Settings(), LAYOUTS, list(MODELS)
    if ns.from_yaml:
        settings, layout, policy = settings_from_yaml(ns.from_yaml)
        layouts, models = (layout,), [policy]
    given = {name: getattr(ns, name) for name in vars(settings) if getattr(ns, name) is not None}
    settings = replace(settings, **given)
    layouts, models = tuple(ns.layouts or layouts), ns.config or models
    print(describe_settings(settings) + "\n")
    for model in models:
        plans = plan_model(model, settings, layouts, ns.reward_config)
        print(f"### {model}\n\n{role_sizes(model, settings, layouts[0], ns.reward_config)}\n")
        print(markdown_table(plans) + "\n")
        print("\n".join(vllm_notes(plans)) + "\n")


if __name__ == "__main__":
    main()
