"""lightning_ppo through the real Lightning ``Trainer`` and ``PPOLightningModule``.

Logger, checkpointing, progress bar and model summary are off; ``ppo.advantage_estimator`` is
``gae`` with the default separate value model (built from the policy checkpoint), or a value head
on the policy's backbone for the ``lightning_ppo_shared`` variant; ``spec.engine`` is
``generation.engine`` (``vllm`` for the ``lightning_ppo_vllm`` variant, which the driver runs with
the vLLM environment's interpreter); ``lightning_ppo_budget`` sets ``ppo.micro_batch_tokens``,
``lightning_ppo_compiled`` sets ``ppo.torch_compile`` (the loss passes under ``torch.compile``) and
``lightning_ppo_padded`` computes every forward on the padded rectangle (the row groups and
micro-batch trimming patched out: what lightning_ppo computed before them); the reward is
the same reward-model checkpoint TRL and the floor use; gradient clipping is off because TRL's
PPO does not clip either. Phase timers wrap the module's own methods on the instance (the class
is not changed), so the breakdown shows where an iteration's time goes.

    python -m benchmarks.run_lightning SPEC.json RESULT.json
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import lightning_ppo.module
import lightning_ppo.rewards
from benchmarks import common
from lightning_ppo import PPOLightningModule
from lightning_ppo.config import GenerationConfig, PPOConfig
from lightning_ppo.data import PromptDataModule
from lightning_ppo.ppo.microbatches import MicroBatch, Share
from lightning_ppo.ppo.row_groups import RowGroup
from lightning_ppo.tasks.digits import DigitsDataModule

# What one training_step calls, timed as phases (the floor times the same passes): methods of
# the module, and functions module.py imports. A name that is not there (the module was
# refactored) is skipped; its time then shows up in step_other.
METHOD_PHASES = {
    "generate": "generate",
    "decode_responses": "decode",
    "score": "reward",
    "shape_scores": "shape_scores",
    "rollout_forwards": "rollout_forwards",
    "ppo_update": "train",
    "log_stats": "log",
}
FUNCTION_PHASES = {"make_experience": "experience", "experience_metrics": "stats"}
# Phases timed inside another phase (``weight_push`` inside ``generate``): not summed again.
NESTED_PHASES = ("weight_push",)


class Clock(Callback):
    """Marks the end of every PPO iteration (one training batch) and closes its phase record."""

    def __init__(
        self, clock: common.IterationClock, timer: common.PhaseTimer, result: common.RunResult
    ) -> None:
        self.clock, self.timer, self.result = clock, timer, result

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.clock.marks:
            self.clock.mark()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock.mark()
        self.timer.end_iteration()

    def on_train_end(self, trainer, pl_module) -> None:
        # before the strategy's teardown, which moves the module and the optimizer state to the CPU
        self.result.train_rss_mib = common.peak_rss_mib()


def build_module(spec: common.RunSpec) -> PPOLightningModule:
    ppo = PPOConfig(
        advantage_estimator="gae",
        ppo_epochs=spec.ppo_epochs,
        num_minibatches=spec.num_minibatches,
        clip_range=common.CLIP_RANGE,
        value_clip_range=common.VALUE_CLIP_RANGE,
        vf_coef=common.VF_COEF,
        kl_coef=common.KL_COEF,
        gamma=common.GAMMA,
        gae_lambda=common.GAE_LAMBDA,
        max_grad_norm=None,
        micro_batch_tokens=spec.micro_batch_tokens,
        torch_compile=spec.variant == "lightning_ppo_compiled",
    )
    generation = GenerationConfig(
        max_new_tokens=spec.response_length,
        temperature=common.TEMPERATURE,
        engine=spec.engine,
        cache_implementation=spec.cache,
        compile=spec.variant == "lightning_ppo_compiled",  # decoding compiled too (generation.compile)
        # On CPU vLLM sizes its KV cache from the machine's memory: 10 % is ample for the presets.
        gpu_memory_utilization=0.3 if spec.device.startswith("cuda") else 0.1,
    )
    optimizer = functools.partial(torch.optim.AdamW, lr=common.LEARNING_RATE, weight_decay=0.0)
    return PPOLightningModule(
        policy=spec.policy,
        reward_model=spec.reward,
        ppo=ppo,
        generation=generation,
        optimizer=optimizer,
        value_model="shared" if spec.variant == "lightning_ppo_shared" else "separate",
        value=spec.policy,  # the critic starts from the policy, as in TRL and the floor
        seed=spec.seed,
    )


def instrument(module: PPOLightningModule, timer: common.PhaseTimer, result: common.RunResult) -> None:
    """Time the phases on this instance (the class is untouched) and in module.py's namespace."""
    for name, phase in METHOD_PHASES.items():
        if hasattr(module, name):
            setattr(module, name, timer.wrap(phase, getattr(module, name)))
    for name, phase in FUNCTION_PHASES.items():
        if hasattr(lightning_ppo.module, name):
            setattr(lightning_ppo.module, name, timer.wrap(phase, getattr(lightning_ppo.module, name)))
    module.training_step = timer.wrap("training_step", module.training_step)

    make_engine = lightning_ppo.module.engine_for_trainer

    def make_timed_engine(*args, **kwargs):
        engine = make_engine(*args, **kwargs)
        engine.sync_weights = timer.wrap("weight_push", engine.sync_weights)
        return engine

    lightning_ppo.module.engine_for_trainer = make_timed_engine

    generate = module.generate

    def generate_and_record_width(batch):
        rollout = generate(batch)
        result.response_width = rollout.response_ids.shape[1]
        return rollout

    module.generate = generate_and_record_width


def pad_every_forward() -> None:
    """The padded path: every forward on the whole rectangle (one group of all rows and columns;
    each minibatch one untrimmed micro-batch: the benchmark does not accumulate)."""

    def one_group(mask, split, *args, **kwargs):
        return [RowGroup(torch.arange(len(mask)), split, mask.shape[1] - split)]

    def whole_minibatch(facts, rows, *args, **kwargs):
        return [MicroBatch(rows, [0, facts.length - 1], Share())]

    lightning_ppo.module.forward_groups = lightning_ppo.rewards.forward_groups = one_group
    lightning_ppo.module.plan_minibatch = whole_minibatch


def count_tokens(result: common.RunResult) -> None:
    """Add the policy forwards' computed (rows x columns) and real tokens up in ``result``."""
    groups_of, cut = lightning_ppo.module.forward_groups, lightning_ppo.module.cut_micro_batches

    def counted_groups(mask, split, *args, **kwargs):
        groups = groups_of(mask, split, *args, **kwargs)
        result.tokens_computed += sum(g.area for g in groups)
        result.tokens_real += int(mask.sum())
        return groups

    def counted_cut(*args, **kwargs):
        for micro_batches in cut(*args, **kwargs):
            result.tokens_computed += sum(micro.input_ids.numel() for micro, _ in micro_batches)
            result.tokens_real += sum(int(micro.attention_mask.sum()) for micro, _ in micro_batches)
            yield micro_batches

    lightning_ppo.module.forward_groups, lightning_ppo.module.cut_micro_batches = counted_groups, counted_cut


def cut_at_scheduled_lengths(module: PPOLightningModule, spec: common.RunSpec) -> None:
    """The variable workload: every response cut at its prompt's scheduled length."""
    generate, pad = module.generate, module.tokenizer.pad_token_id

    def scheduled(batch):
        rollout = generate(batch)
        ids, mask = common.length_schedule(rollout.response_ids, batch.prompts, spec.response_length, pad)
        return dataclasses.replace(
            rollout, response_ids=ids, response_mask=mask, ended=torch.ones_like(rollout.ended)
        )

    module.generate = scheduled


def prompt_data(spec: common.RunSpec):
    if spec.workload == "fixed":
        return DigitsDataModule(
            num_prompts=spec.batch_size * spec.iterations,
            num_digits=common.prompt_digits(spec.prompt_length),
            batch_size=spec.batch_size,
            max_prompt_length=max(16, spec.prompt_length),
            seed=spec.seed,
        )
    prompts = common.variable_prompts(spec.batch_size * spec.iterations, spec.response_length, spec.seed)
    return PromptDataModule(
        prompts=prompts, batch_size=spec.batch_size, max_prompt_length=2 * spec.response_length, shuffle=False
    )


def split_overhead(phases: list[dict[str, float]], intervals: list[float]) -> list[dict[str, float]]:
    """Replace ``training_step`` by what the named phases leave of it (``step_other``) and add the
    time of the iteration spent outside ``training_step`` (``lightning_loop``: data, hooks, logging)."""
    out = []
    for phase, interval in zip(phases, intervals, strict=False):
        phase = dict(phase)
        step = phase.pop("training_step", 0.0)
        phase["step_other"] = step - sum(v for k, v in phase.items() if k not in NESTED_PHASES)
        phase["lightning_loop"] = interval - step
        out.append(phase)
    return out


def run(spec: common.RunSpec) -> common.RunResult:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    seed_everything(spec.seed, verbose=False)
    result = common.RunResult(spec=vars(spec))
    timer = common.PhaseTimer(spec.device, spec.phases)
    clock = common.IterationClock(spec.device)
    module = build_module(spec)
    if spec.variant == "lightning_ppo_padded":
        pad_every_forward()
    if spec.workload == "variable":
        cut_at_scheduled_lengths(module, spec)
        count_tokens(result)
    instrument(module, timer, result)
    data = prompt_data(spec)
    trainer = Trainer(
        accelerator="cuda" if spec.device.startswith("cuda") else "cpu",
        devices=1,
        precision="32-true" if spec.precision == "32" else spec.precision,
        max_epochs=1,
        limit_train_batches=spec.iterations,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock(clock, timer, result)],
    )
    trainer.fit(module, datamodule=data)
    result.iteration_s, result.gc_s = clock.intervals(), clock.gc_intervals()
    result.phases = split_overhead(timer.history, result.iteration_s) if spec.phases else []
    return common.finish(result, spec.device)


if __name__ == "__main__":
    common.runner_main(run)
