"""TRL 1.12.0's PPO trainer (``trl.experimental.ppo``) on the same checkpoints, prompts and settings.

TRL needs a reward model and a value model that are ``AutoModelForSequenceClassification`` with
one label: the reward model is the shared reward checkpoint, the value model the policy
checkpoint's backbone with a fresh one-output head (as lightning_ppo builds its critic). The
optimizer is TRL's default, fused ``torch.optim.AdamW`` (``optim="adamw_torch_fused"`` with torch
>= 2.8), as in the other variants, with a constant learning rate and no weight decay.
``stop_token="eos"`` truncates responses at EOS like the others (the benchmark's models never
sample EOS, so every response has ``response_length`` tokens). ``bf16-mixed`` is ``bf16=True``
plus ``ACCELERATE_MIXED_PRECISION=bf16`` (what ``accelerate launch --mixed_precision bf16`` sets):
without the variable TRL's PPO silently trains in fp32. The console printer is
removed, like the Lightning logger and progress bar; TRL still computes and ``.item()``s its metrics.
One phase is timed, ``generate``: TRL's ``batch_generation`` (HF ``generate`` of the rollout,
which also keeps the sampling logits), wrapped in the trainer module's namespace.

The variable workload (``spec.workload == "variable"``) gives TRL the same prompts and the same
scheduled response lengths as the others: what ``batch_generation`` returns is cut at each prompt's
length (``common.length_schedule``) by padding the rest, outside the timed phase. TRL reads a
response's length as the tokens before its first pad (``sequence_lengths``), so its masks, rewards and
losses cover exactly the scheduled tokens, as EOS at that place would; EOS itself cannot be written
there, being outside the models' output vocabulary. TRL still computes every forward on the padded
rectangle (as it does with real EOS): the policy tokens counted are its ``ppo_epochs`` passes (its
rollout log-probs come from generation's logits, not from a policy forward).

    python -m benchmarks.run_trl SPEC.json RESULT.json
"""

from __future__ import annotations

import os
import tempfile

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from benchmarks import common


class Clock(TrainerCallback):
    """Marks the start of training and the end of every PPO iteration (TRL's ``on_step_end``)."""

    def __init__(self, clock: common.IterationClock, timer: common.PhaseTimer) -> None:
        self.clock, self.timer = clock, timer

    def on_train_begin(self, args, state, control, **kwargs):
        self.clock.mark()
        self.timer.current.clear()

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.mark()
        self.timer.end_iteration()


def cut_at_scheduled_lengths(ppo_trainer, spec: common.RunSpec, tokenizer, texts, result) -> None:
    """The variable workload: each generated response padded after its prompt's scheduled length,
    and the policy tokens of TRL's PPO passes (rows x columns, and the attended ones) counted."""
    generate, pad = ppo_trainer.batch_generation, tokenizer.pad_token_id
    # TRL's loader shuffles the prompts: each row's text is found by its token ids
    by_ids = {tuple(tokenizer(t)["input_ids"]): t for t in texts}

    def scheduled(model, queries, *args, **kwargs):
        query_responses, logits = generate(model, queries, *args, **kwargs)
        width = queries.shape[1]
        prompts = [by_ids[tuple(row[row != pad].tolist())] for row in queries.cpu()]
        responses, _ = common.length_schedule(query_responses[:, width:], prompts, spec.response_length, pad)
        query_responses = torch.cat([queries, responses], dim=1)
        result.tokens_computed += spec.ppo_epochs * query_responses.numel()
        result.tokens_real += spec.ppo_epochs * int((query_responses != pad).sum())
        return query_responses, logits

    ppo_trainer.batch_generation = scheduled


def run(spec: common.RunSpec) -> common.RunResult:
    # Imported here, after benchmarks.common has silenced TRL's experimental-API notice.
    import trl.experimental.ppo.ppo_trainer as ppo_trainer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.manual_seed(spec.seed)
    result = common.RunResult(spec=vars(spec))
    clock = common.IterationClock(spec.device)
    timer = common.PhaseTimer(spec.device, spec.phases)
    if hasattr(ppo_trainer, "batch_generation"):
        ppo_trainer.batch_generation = timer.wrap("generate", ppo_trainer.batch_generation)
    on_cpu = not spec.device.startswith("cuda")
    bf16 = spec.precision == "bf16-mixed"
    if bf16:
        # PPOTrainer builds its own Accelerator without args.mixed_precision, so bf16=True alone
        # trains in fp32; `accelerate launch --mixed_precision bf16` sets this variable instead.
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    tokenizer = AutoTokenizer.from_pretrained(spec.policy, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(spec.policy)
    reference = AutoModelForCausalLM.from_pretrained(spec.policy)
    value = AutoModelForSequenceClassification.from_pretrained(spec.policy, num_labels=1)
    reward = AutoModelForSequenceClassification.from_pretrained(spec.reward, num_labels=1)
    if spec.workload == "variable":
        texts = common.variable_prompts(spec.batch_size * spec.iterations, spec.response_length, spec.seed)
        cut_at_scheduled_lengths(ppo_trainer, spec, tokenizer, texts, result)
    else:
        texts = common.prompts(spec.batch_size * spec.iterations, spec.seed, spec.prompt_length)
    dataset = Dataset.from_dict({"input_ids": [tokenizer(t)["input_ids"] for t in texts]})
    with tempfile.TemporaryDirectory() as output_dir:
        args = PPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=spec.batch_size,
            gradient_accumulation_steps=1,
            local_rollout_forward_batch_size=spec.batch_size,
            num_mini_batches=spec.num_minibatches,
            num_ppo_epochs=spec.ppo_epochs,
            total_episodes=spec.batch_size * spec.iterations,
            response_length=spec.response_length,
            stop_token="eos",
            temperature=common.TEMPERATURE,
            kl_coef=common.KL_COEF,
            vf_coef=common.VF_COEF,
            cliprange=common.CLIP_RANGE,
            cliprange_value=common.VALUE_CLIP_RANGE,
            gamma=common.GAMMA,
            lam=common.GAE_LAMBDA,
            learning_rate=common.LEARNING_RATE,
            weight_decay=0.0,
            lr_scheduler_type="constant",
            num_sample_generations=0,
            gradient_checkpointing=False,  # TRL's config defaults to True; its PPO loop never enables it
            bf16=bf16,
            use_cpu=on_cpu,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=spec.seed,
        )
        trainer = PPOTrainer(
            args=args,
            processing_class=tokenizer,
            model=policy,
            ref_model=reference,
            reward_model=reward,
            train_dataset=dataset,
            value_model=value,
            callbacks=[Clock(clock, timer)],
        )
        if trainer.accelerator.mixed_precision != ("bf16" if bf16 else "no"):
            raise RuntimeError(
                f"TRL's accelerator runs in {trainer.accelerator.mixed_precision!r}, not {spec.precision}"
            )
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.train()
    result.iteration_s, result.gc_s = clock.intervals(), clock.gc_intervals()
    result.phases = timer.history if spec.phases else []
    result.response_width = spec.response_length
    return common.finish(result, spec.device)


if __name__ == "__main__":
    common.runner_main(run)
