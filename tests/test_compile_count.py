"""``ppo.torch_compile`` compiles the loss pass once, whatever the micro-batches' shapes and shares.

Counted with torch.compile's ``eager`` backend (benchmarks.compile_count.CompileCount): dynamo
builds, guards and recompiles its graphs as it does for inductor, without generating code, so a
20-iteration run takes seconds. Before lightning_ppo.ppo.compiled_loss, the quickstart's first iteration
compiled 8 times, hit the recompile limit, and every later pass ran uncompiled.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.compile_count import KL_IN_LOSS, CompileCount, Setting, run
from lightning_ppo import PPOConfig, PPOLightningModule
from lightning_ppo.models.roles import LoraSettings
from lightning_ppo.ppo.experience import Experience
from lightning_ppo.ppo.microbatches import Share
from lightning_ppo.ppo.rollout_data import position_ids_from_mask
from lightning_ppo.tasks.digits import DigitsReward
from tests.tolerances import magnitude, reordered_tolerance


def test_twenty_quickstart_iterations_compile_the_loss_once(tiny_digits, tmp_path):
    """The quickstart's settings, the KL coefficient in the loss and moving every iteration."""
    with CompileCount() as count:
        log = run(tiny_digits, 20, compiled=True, setting=Setting(ppo=KL_IN_LOSS), root=tmp_path)
    # more micro-batch shapes than the recompile limit (8), and 20 coefficients
    assert len(count.shapes) > 8
    assert len(set(log.kl_coefs)) == 20
    assert (count.graphs, count.frames, count.breaks, count.limit_hit) == (1, 1, 0, False)


def micro_batch(rows: int, prompt: int, response: int, generator: torch.Generator) -> Experience:
    """Left-padded prompts, responses of 1 to ``response`` tokens (the first row's the longest)."""
    prompt_mask = torch.arange(prompt) >= torch.randint(0, prompt, (rows, 1), generator=generator)
    lengths = torch.randint(1, response + 1, (rows,), generator=generator)
    lengths[0] = response
    response_mask = torch.arange(response) < lengths[:, None]
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    ids = torch.randint(0, 10, (rows, prompt + response), generator=generator)

    def per_token(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, response, generator=generator) * scale * response_mask

    return Experience(
        ids, mask, position_ids_from_mask(mask), ids[:, prompt:].contiguous(), response_mask,
        -per_token().abs(), -per_token().abs(), per_token(), torch.randn(rows, generator=generator),
        per_token(), per_token(), per_token(), per_token(),
    )  # fmt: skip


# (rows, prompt columns, response columns): torch specialises sizes 0 and 1, and a prompt of one
# column makes logits_to_keep keep every position
SHAPES = [(8, 6, 8), (1, 6, 3), (3, 6, 1), (1, 6, 1), (7, 5, 7), (12, 3, 2), (2, 1, 1), (1, 1, 1), (33, 6, 8)]


@pytest.mark.parametrize(
    "arch, settings",
    [
        ("gpt2", {"ppo": PPOConfig(entropy_coef=0.01, **KL_IN_LOSS)}),
        ("gpt2", {"value_model": "shared", "ppo": PPOConfig(loss_aggregation="sequence_mean")}),
        ("llama", {"lora": LoraSettings(), "gradient_checkpointing": True, "ppo": PPOConfig(**KL_IN_LOSS)}),
    ],
    ids=["kl-in-loss", "shared-critic", "lora-checkpointing"],
)
def test_micro_batches_of_every_shape_share_one_graph(arch, settings, tiny_gpt2, tiny_llama):
    """One row, one response column, one prompt column, new shares and coefficients on every call:
    one graph, no graph break (LoRA with checkpointing broke into a graph per block before), and
    eager mode's losses, statistics and gradients to float32 rounding."""
    policy = {"gpt2": tiny_gpt2, "llama": tiny_llama}[arch]
    settings = {**settings, "ppo": PPOConfig(**{**vars(settings["ppo"]), "torch_compile": True})}
    module = PPOLightningModule(policy=str(policy), reward_fn=DigitsReward(), **settings)
    module.load_weights()
    trained = [p for p in module.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    calls = [
        (micro_batch(*shape, generator), Share(*torch.rand(3, generator=generator).tolist()), float(kl))
        for shape, kl in zip(SHAPES, torch.rand(len(SHAPES), generator=generator), strict=True)
    ]

    def passes(loss_pass):
        results = []
        for mb, share, kl in calls:
            module.kl_ctl.value = kl
            loss, stats = loss_pass(mb, share)
            grads = torch.autograd.grad(loss, trained)
            results.append((loss.detach(), {k: v.detach() for k, v in stats.items()}, grads))
        return results

    with module.roles.updating():
        module.ppo_loss(*calls[0][:2])  # as the rollout forwards do first: HF installs its output hooks
        eager = passes(module.ppo_loss)  # before compiling, which removes the input-gradient hooks
        with CompileCount() as count:
            compiled = passes(module.loss_pass)
    assert (count.graphs, count.frames, count.breaks) == (1, 1, 0)
    for (loss, stats, grads), (want_loss, want_stats, want_grads) in zip(compiled, eager, strict=True):
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=reordered_tolerance(want_loss, terms=1.0))
        assert stats.keys() == want_stats.keys()
        for key, want in want_stats.items():
            torch.testing.assert_close(stats[key], want, rtol=0, atol=reordered_tolerance(want, 1.0), msg=key)
        largest = max(magnitude(want) for want in want_grads)  # rounding: of the largest gradient
        torch.testing.assert_close(grads, want_grads, rtol=0, atol=reordered_tolerance(largest))
