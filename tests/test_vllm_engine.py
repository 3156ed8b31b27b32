"""The vLLM engine against the trainer, on a tiny fp32 GPT-2 on CPU (``make test-vllm``).

Skipped where vllm is not importable (the main environment: vLLM pins transformers < 5.20).
One engine serves every test: vLLM sets up process-wide state once per process.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule  # noqa: E402
from lightning_ppo.callbacks import summarise  # noqa: E402
from lightning_ppo.config import EpisodeConfig  # noqa: E402
from lightning_ppo.models.loading import load_causal_lm, response_logits  # noqa: E402
from lightning_ppo.ppo import functional as F  # noqa: E402
from lightning_ppo.rollout.engines.vllm import VLLMEngine  # noqa: E402
from lightning_ppo.rollout.episodes import Environment, EpisodeRunner, StepResult  # noqa: E402
from lightning_ppo.rollout.sampling import generate, hf_generation_config  # noqa: E402
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint  # noqa: E402
from tests.helpers import lora_that_matters, prompt_data, quickstart_csv_args, quiet_trainer  # noqa: E402

# Measured on a 2-core x86 CPU, fp32, this model, 64 prompts x 8 tokens: the largest
# |logp_engine - logp_trainer| over 5 batches (~450 sampled tokens each) was 2.4e-5, the mean
# 1.5e-6 (vLLM's CPU attention and GEMMs against HF's eager forward); a 4 x 256 GPT-2 with 32
# tokens: largest 5e-4, mean 1.1e-5.
LOGPROB_TOLERANCE = 1e-4
PROMPTS = [f"{i % 10}{(3 * i) % 10}{(7 * i) % 10}" for i in range(64)]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 x 128 GPT-2 (head size 64: vLLM's CPU attention has no kernel for 16) whose weights are
    spread wide enough that greedy decoding varies between prompts and sometimes stops."""
    out = make_tiny_checkpoint(tmp_path_factory.mktemp("vllm_gpt2"), TinyModelSpec(n_embd=128, n_head=2))
    model = load_causal_lm(str(out))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def module(policy_dir: Path) -> PPOLightningModule:
    generation = GenerationConfig(
        max_new_tokens=8,
        temperature=0.8,
        stop_token="=",
        engine="vllm",
        engine_is_correction="token",
        gpu_memory_utilization=0.1,
    )
    return PPOLightningModule(
        policy=str(policy_dir),
        reward_fn=length_reward,
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2),
        generation=generation,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )


def length_reward(prompts, completions, batch):
    """Longer is better: responses that stop early score less, so advantages are not all 0."""
    return [float(len(c)) for c in completions]


def _batch(module: PPOLightningModule):
    data = prompt_data()
    data.set_tokenizer(module.tokenizer)
    return data.make_batch(PROMPTS)


def _trainer_logprobs(module: PPOLightningModule, rollout) -> torch.Tensor:
    with torch.no_grad():
        return module.rollout_forwards(rollout).logprobs


def test_engine_is_vllm(module):
    assert isinstance(module.engine, VLLMEngine)


def test_greedy_responses_and_masks_equal_hf_generate(module):
    engine = module.engine
    batch = _batch(module)
    greedy = hf_generation_config(module.generation_config, module.stop_token_id, 0, do_sample=False)
    sampling = engine.hf_generation
    engine.hf_generation = greedy
    try:
        engine.sync_weights(module.policy)
        rollout = engine.generate(batch.prompt_ids, batch.prompt_mask)
    finally:
        engine.hf_generation = sampling
    expected = generate(module.policy, batch.prompt_ids, batch.prompt_mask, greedy)
    assert torch.equal(rollout.response_mask, expected.response_mask)
    assert torch.equal(rollout.response_ids, expected.response_ids)
    assert torch.equal(rollout.ended, expected.ended)
    # the check means something: responses differ between prompts, some stop and some run out
    assert len({tuple(r) for r in expected.response_ids.tolist()}) > 8
    assert 0 < int(expected.ended.sum()) < len(PROMPTS)


def test_sampled_engine_logprobs_equal_the_trainers(module):
    torch.manual_seed(0)
    rollout = module.generate(_batch(module))
    mask = rollout.response_mask
    assert rollout.engine_logprobs is not None and int(mask.sum()) > 256
    diff = (rollout.engine_logprobs - _trainer_logprobs(module, rollout))[mask].abs().max().item()
    assert diff < LOGPROB_TOLERANCE, diff
    # masks come from the stop token, exactly as for HF generate
    assert not rollout.engine_logprobs[~mask].any()


def test_after_a_ppo_iteration_the_engine_samples_from_the_updated_policy(module, tmp_path):
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, prompt_data())
    changed = max((p.detach() - before[n]).abs().max().item() for n, p in module.policy.named_parameters())
    assert changed > 1e-3
    # the iteration logged the engine-vs-trainer mismatch (fresh weights: within the tolerance)
    assert trainer.callback_metrics["engine/logp_abs_diff"].item() < LOGPROB_TOLERANCE
    assert trainer.callback_metrics["engine/is_truncated_fraction"].item() == 0.0
    batch = _batch(module)
    # the engine still holds the weights it sampled the iteration with: far from the updated policy
    torch.manual_seed(1)
    stale = module.engine.generate(batch.prompt_ids, batch.prompt_mask)
    stale_diff = (stale.engine_logprobs - _trainer_logprobs(module, stale))[stale.response_mask].abs()
    assert stale_diff.mean().item() > 100 * LOGPROB_TOLERANCE
    # module.generate pushes the updated weights first: the distributions agree again
    torch.manual_seed(1)
    fresh = module.generate(batch)
    diff = (fresh.engine_logprobs - _trainer_logprobs(module, fresh))[fresh.response_mask].abs()
    assert diff.max().item() < LOGPROB_TOLERANCE


def test_lora_policy_is_pushed_merged_and_left_unmerged(module, policy_dir):
    """The engine samples from base + adapter; the trained PeftModel keeps its adapter apart."""
    policy = lora_that_matters(policy_dir)
    batch = _batch(module)
    greedy = hf_generation_config(module.generation_config, module.stop_token_id, 0, do_sample=False)
    expected = generate(policy, batch.prompt_ids, batch.prompt_mask, greedy)
    base = generate(module.policy, batch.prompt_ids, batch.prompt_mask, greedy)
    assert not torch.equal(expected.response_ids, base.response_ids)
    engine = module.engine
    sampling = engine.hf_generation
    engine.hf_generation = greedy
    try:
        engine.sync_weights(policy)
        rollout = engine.generate(batch.prompt_ids, batch.prompt_mask)
    finally:
        engine.hf_generation = sampling
    assert torch.equal(rollout.response_ids, expected.response_ids)
    assert torch.equal(rollout.response_mask, expected.response_mask)
    # unmerged again: the policy still generates what it generated before the push
    again = generate(policy, batch.prompt_ids, batch.prompt_mask, greedy)
    assert torch.equal(again.response_ids, expected.response_ids)
    assert not any(getattr(m, "merged", False) for m in policy.modules())


# vLLM's messages about this package's own choices (lightning_ppo.runs.quiet): none may reach the log.
OURS = ("Failed to load weights", "Chat template warmup failed", "The global random seed is set to")


def _fit_in_a_process(
    tmp_path: Path, overrides: dict[str, str], policy: Path | None = None
) -> list[dict[str, str]]:
    """``lightning-ppo fit`` of the quickstart config with ``engine: vllm`` in a process of its own
    (one engine per process, as in a real run: a second in-process vLLM engine miscounts the CPU
    memory left for its KV cache); the CSV rows of its iterations. The checkpoint has one head of
    64: the quickstart's four heads of 16 have no vLLM CPU attention kernel."""
    if policy is None:
        policy = make_tiny_checkpoint(tmp_path / "digits", TinyModelSpec(n_head=1), alphabet="0123456789=")
    args = quickstart_csv_args(policy, tmp_path, {"--model.init_args.generation.engine": "vllm", **overrides})
    command = [sys.executable, "-m", "lightning_ppo.cli"]  # Lightning re-runs it per rank
    run = subprocess.run(command + args, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    log = run.stdout + run.stderr  # vLLM logs to stdout
    assert not [text for text in OURS if text in log], log[-3000:]
    with open(next(tmp_path.glob("csv/version_*/metrics.csv"))) as file:
        return [row for row in csv.DictReader(file) if row.get("objective/scores")]


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        '{"class_path": "lightning.pytorch.strategies.ModelParallelStrategy", '
        '"init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}',
    ],
    ids=["ddp", "fsdp2"],
)
def test_two_ranks_each_push_the_updated_weights_into_their_engine(strategy, tmp_path):
    """Two CPU ranks (gloo), one engine each under vLLM's external launcher; under FSDP2 every
    weight is gathered from its shards (``full_tensor()``) for the push. After each update the
    engines sample from the new weights: the logged mismatch stays at float rounding."""
    rows = _fit_in_a_process(
        tmp_path,
        {"--trainer.devices": "2", "--trainer.strategy": strategy, "--trainer.limit_train_batches": "3"},
    )
    assert len(rows) == 3
    assert float(rows[-1]["objective/kl"]) > 0  # the policy moved away from the reference
    assert all(float(r["engine/logp_abs_diff"]) < LOGPROB_TOLERANCE for r in rows)


@pytest.mark.slow
def test_quickstart_task_score_rises_with_the_vllm_engine(tmp_path):
    """The quickstart run of tests/test_learning.py (60 iterations, GAE) with ``engine: vllm`` and
    the token-level correction."""
    rows = _fit_in_a_process(
        tmp_path,
        {
            "--model.init_args.ppo.kl_coef": "0.02",
            "--model.init_args.generation.engine_is_correction": "token",
            "--trainer.limit_train_batches": "60",
        },
    )
    summary = summarise([float(r["objective/scores"]) for r in rows], float(rows[-1]["objective/kl"]), 0.0)
    assert summary.iterations == 60
    # the same bounds as the HF engine's run in tests/test_learning.py
    assert summary.first_score < 0.4
    assert summary.last_score > summary.first_score + 0.15
    assert summary.final_kl < 20.0
    # every iteration logged the engine-vs-trainer mismatch
    assert all(float(r["engine/logp_abs_diff"]) < 10 * LOGPROB_TOLERANCE for r in rows)


@pytest.mark.slow
def test_a_vllm_run_resumes_exactly(tmp_path):
    """2N == N + N with the vLLM engine: vLLM reseeds Python, NumPy and torch when its worker
    starts (lazily, at the first generate), which overwrote the RNG state a resumed run restored,
    so the resumed run drew iteration 0's sampling seeds again. Every vLLM call now runs inside a
    fork of the process's RNGs."""
    policy = make_tiny_checkpoint(tmp_path / "digits", TinyModelSpec(n_head=1), alphabet="0123456789=")
    saver = {
        "class_path": "lightning_ppo.checkpoint.PPOCheckpoint",
        "init_args": {"every_n_iterations": 2, "save_top_k": -1, "dirpath": str(tmp_path / "ckpt")},
    }
    saving = {"--trainer.enable_checkpointing": "true", "--trainer.callbacks": json.dumps([saver])}
    whole = _fit_in_a_process(
        tmp_path / "whole", {**saving, "--trainer.limit_train_batches": "4"}, policy=policy
    )
    resumed = _fit_in_a_process(
        tmp_path / "resumed",
        {
            "--trainer.limit_train_batches": "4",
            "--ckpt_path": str(tmp_path / "ckpt" / "iteration=2.ckpt"),
        },
        policy=policy,
    )
    assert [r["iteration"] for r in resumed] == ["3.0", "4.0"]
    for key in ("objective/scores", "objective/kl", "response/length_mean", "loss/policy_avg"):
        assert [r[key] for r in resumed] == [r[key] for r in whole[2:]], key


def test_suppressed_tokens_are_never_sampled_and_logprobs_use_the_same_mask(module):
    suppressed = [module.tokenizer.convert_tokens_to_ids(t) for t in ("1", "5")]
    settings = GenerationConfig(max_new_tokens=8, temperature=0.8, stop_token="=")
    engine = module.engine
    sampling = engine.hf_generation
    engine.hf_generation = hf_generation_config(settings, module.stop_token_id, 0, suppressed=suppressed)
    try:
        engine.sync_weights(module.policy)
        torch.manual_seed(3)
        batch = _batch(module)
        rollout = engine.generate(batch.prompt_ids, batch.prompt_mask)
    finally:
        engine.hf_generation = sampling
    mask = rollout.response_mask
    assert not torch.isin(rollout.response_ids[mask], torch.tensor(suppressed)).any()
    with torch.no_grad():
        logits = response_logits(
            module.policy, rollout.input_ids, rollout.attention_mask, rollout.position_ids, mask.shape[1]
        )
    expected = F.logprobs_from_logits(logits, rollout.response_ids, 0.8, suppressed)
    assert (rollout.engine_logprobs - expected)[mask].abs().max().item() < LOGPROB_TOLERANCE


def test_multi_turn_episodes_keep_the_engines_tokens_and_log_probs_across_turns(module):
    """Token continuity with the engine's own sampling log-probs: every turn's reply, read back by the
    trainer inside the whole episode (observations between the turns), has the log-probs vLLM sampled
    it with."""

    class Ask(Environment):
        def step(self, turn):
            return StepResult(observation=" go on ", reward=1.0)

    runner = EpisodeRunner(Ask(), EpisodeConfig(max_turns=3, max_tokens=40), module.tokenizer, 0, seed=0)
    torch.manual_seed(0)
    module.engine.sync_weights(module.policy)
    rollout = runner.run(module.engine, _batch(module), iteration=0, rank=0)
    assert rollout.context_mask is not None and rollout.engine_logprobs is not None
    assert runner.last_stats.turns.float().mean().item() > 2.0  # most episodes ran all three turns
    mask = rollout.response_mask
    diff = (rollout.engine_logprobs - _trainer_logprobs(module, rollout))[mask].abs().max().item()
    assert diff < LOGPROB_TOLERANCE, diff
    assert not rollout.engine_logprobs[rollout.context_mask].any()  # observations were never sampled
