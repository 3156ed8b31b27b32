"""The PPO update on variable-length sequences: padded micro-batches against trimmed and token-budget ones.

    .venv/bin/python -m benchmarks.variable_length               # 3 rounds, 64 sequences
    .venv/bin/python -m benchmarks.variable_length --rounds 1    # a smoke run

What it measures: one PPO epoch only (2 minibatches of 32 sequences, 4 micro-batches each), on
one rollout batch built directly with a realistic spread: prompts of 8 to 256 tokens and
responses of 1 to 128 (uniform, seeded), a random 4 x 256 GPT-2 with a separate critic of the same
size, fp32, CPU. Variants, alternated round by round in this process:

* ``padded``: micro-batches of equal count, each the full rectangle of the batch (what every
  micro-batch cost before trimming);
* ``trimmed``: the same micro-batches, each trimmed to its own longest sequence (the default now);
* ``token budget``: ``ppo.micro_batch_tokens`` = a quarter of a minibatch's padded tokens, sequences
  sorted by length and packed, each trimmed.

The rollout's own forwards (policy, reference, critic) are not part of it: they still run on the
padded rectangle. Reported: seconds per PPO update (median), tokens computed per update (rows x
columns of every forward) and the real ones among them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.experience import Experience
from lightning_ppo.microbatches import Share, plan_micro_batches
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

BATCH, MINIBATCHES, EPOCHS, MICRO = 64, 2, 1, 4


def synthetic_experience(vocab: int, seed: int = 0) -> Experience:
    """A rollout batch of BATCH sequences: prompts 8-256 tokens (left padded), responses 1-128."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(8, 257, (BATCH,), generator=gen)
    responses = torch.randint(1, 129, (BATCH,), generator=gen)
    width_p, width_r = int(prompts.max()), int(responses.max())
    columns_p, columns_r = torch.arange(width_p), torch.arange(width_r)
    prompt_mask = columns_p[None, :] >= (width_p - prompts)[:, None]
    response_mask = columns_r[None, :] < responses[:, None]
    ids = torch.randint(3, vocab, (BATCH, width_p + width_r), generator=gen)
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    positions = (attention.long().cumsum(1) - 1).clamp(min=0)
    zeros = torch.zeros(BATCH, width_r)
    noise = torch.randn(BATCH, width_r, generator=gen).masked_fill(~response_mask, 0.0)
    return Experience(
        input_ids=ids,
        attention_mask=attention,
        position_ids=positions,
        response_ids=ids[:, width_p:],
        response_mask=response_mask,
        logprobs=zeros - 3.0,
        ref_logprobs=zeros - 3.0,
        values=zeros,
        scores=torch.zeros(BATCH),
        kl=zeros,
        rewards=zeros,
        advantages=noise,
        returns=noise,
    )


def update(module: PPOLightningModule, exp: Experience, variant: str) -> tuple[float, int, int]:
    """One PPO update's seconds, computed tokens and real tokens (the optimizer step left out)."""
    generator = torch.Generator().manual_seed(0)
    computed = real = 0
    start = time.perf_counter()
    for minibatch in exp.minibatches(MINIBATCHES, generator, epochs=EPOCHS):
        if variant == "padded":
            plan = [(micro, Share(1 / MICRO, 1 / MICRO, 1 / MICRO)) for micro in minibatch.split(MICRO)]
        elif variant == "trimmed":
            plan = plan_micro_batches(minibatch, MICRO)
        else:
            plan = plan_micro_batches(minibatch, 1, token_budget=minibatch.input_ids.numel() // MICRO)
        for micro, share in plan:
            loss, _ = module.ppo_loss(micro, share)
            loss.backward()
            computed += micro.input_ids.numel()
            real += int(micro.attention_mask.sum())
        module.zero_grad(set_to_none=True)
    return time.perf_counter() - start, computed, real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(n_layer=4, n_embd=256, n_head=4, n_positions=512)
        path = make_tiny_checkpoint(Path(tmp) / "policy", spec)
        torch.manual_seed(0)
        module = PPOLightningModule(
            policy=str(path),
            reward_fn=lambda prompts, completions, batch: [0.0] * len(completions),
            ppo=PPOConfig(ppo_epochs=EPOCHS, num_minibatches=MINIBATCHES, gradient_accumulation_steps=MICRO),
            generation=GenerationConfig(max_new_tokens=128),
        )
        exp = synthetic_experience(len(module.tokenizer))
        results: dict[str, list[tuple[float, int, int]]] = {"padded": [], "trimmed": [], "token budget": []}
        for _ in range(ns.rounds):
            for variant in results:
                results[variant].append(update(module, exp, variant))
    threads = torch.get_num_threads()
    print(f"{ns.rounds} rounds; {BATCH} sequences, prompts 8-256 + responses 1-128 tokens; {threads} threads")
    print("| variant | s / update (median) | vs padded | tokens computed / update | real tokens among them |")
    print("| --- | --- | --- | --- | --- |")
    padded = statistics.median(r[0] for r in results["padded"])
    for variant, runs in results.items():
        seconds = statistics.median(r[0] for r in runs)
        computed, real = runs[0][1], runs[0][2]
        share = f"{real:,} ({real / computed:.0%})"
        print(f"| {variant} | {seconds:.2f} | {seconds / padded:.2f}x | {computed:,} | {share} |")


if __name__ == "__main__":
    main()
