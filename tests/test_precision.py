"""Every precision the Trainer offers, with every model family: generation and training run right.

A RoPE model under autocast writes fp32 keys and low-precision values into the generation cache
(transformers up to 5.23 then failed in the static cache); a true-precision plugin makes the low
dtype the default one, so a buffer whose dtype was not chosen takes it. These run on the oldest
supported versions too (``make test-oldest``).
"""

from __future__ import annotations

import math

import pytest
import torch

import lightning_ppo.rollout.sampling as rollout_module
from lightning_ppo.config import GenerationConfig, PPOConfig
from lightning_ppo.models.loading import load_causal_lm
from lightning_ppo.models.roles import LoraSettings
from lightning_ppo.module import PPOLightningModule
from lightning_ppo.rollout.sampling import OneDtypeStaticCache, generate, hf_generation_config
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.preflight import check_precision
from lightning_ppo.tasks.tiny import ARCHS, TinyModelSpec, make_tiny_checkpoint
from tests.helpers import CountCharReward, cli_usage_error, prompt_data, quickstart_fit_args, quiet_trainer
from tests.tolerances import LargestLogit, log_prob_tolerance

PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
# the dtype the LM head's logits are rounded to under each precision
LOGITS_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16}
# the dtype the trained weights live in under each precision
WEIGHT_DTYPES = {"bf16-true": torch.bfloat16}
ITERATIONS, EPOCHS, MINIBATCHES = 2, 1, 1


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One tiny checkpoint per family: GPT-2 (no RoPE), Llama, Qwen2 (q/k/v biases, grouped
    queries), Mistral (grouped queries, a sliding window)."""
    root = tmp_path_factory.mktemp("families")
    return {arch: str(make_tiny_checkpoint(root / arch, TinyModelSpec(arch=arch))) for arch in ARCHS}


def fit(
    policy: str, precision: str, cache: str = "static", lora: bool = False, accelerator="cpu", callbacks=()
) -> tuple:
    module = PPOLightningModule(
        policy,
        reward_fn=CountCharReward(),
        lora=LoraSettings(r=4) if lora else None,
        ppo=PPOConfig(ppo_epochs=EPOCHS, num_minibatches=MINIBATCHES),
        generation=GenerationConfig(max_new_tokens=8, cache_implementation=cache),
    )
    trainer = quiet_trainer(
        "unused",
        iterations=ITERATIONS,
        precision=precision,
        accelerator=accelerator,
        callbacks=[*callbacks, LargestLogit()],
    )
    trainer.fit(module, datamodule=prompt_data(4))
    return module, trainer, {k: float(v) for k, v in trainer.callback_metrics.items()}


def check_trained(module, trainer, metrics: dict[str, float], precision: str) -> None:
    assert module.iteration == ITERATIONS
    assert trainer.global_step == ITERATIONS * EPOCHS * MINIBATCHES
    assert metrics["train/skipped_updates"] == 0  # every step had finite gradients
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    # One epoch of one minibatch: the policy that sampled, so a ratio of 1 up to the precision's
    # rounding of the log-probs, |exp(d) - 1| <= expm1(|d|); |log p| <= 2 max|z| + log(vocabulary).
    largest = next(c for c in trainer.callbacks if isinstance(c, LargestLogit)).value
    log_prob_scale = 2 * largest + math.log(module.policy.config.vocab_size)
    tolerance = log_prob_tolerance(LOGITS_DTYPES.get(precision, torch.float32), largest, log_prob_scale)
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=math.expm1(tolerance))
    trained = [p for p in module.parameters() if p.requires_grad]
    assert {p.dtype for p in trained} == {WEIGHT_DTYPES.get(precision, torch.float32)}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_generates_and_trains_under_every_precision(checkpoints, arch, precision):
    module, trainer, metrics = fit(checkpoints[arch], precision)
    check_trained(module, trainer, metrics, precision)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_lora_on_a_rope_policy_trains_under_every_precision_with_either_cache(checkpoints, precision, cache):
    module, trainer, metrics = fit(checkpoints["llama"], precision, cache, lora=True)
    check_trained(module, trainer, metrics, precision)


class Fp32StaticCache(OneDtypeStaticCache):
    """The reference: keys and values both stored in fp32, exactly as written (values cast up
    losslessly), on every transformers version, attended over as the cache under test attends
    (its written tokens: ``trim``). It records the dtypes the model writes."""

    written: set[tuple[torch.dtype, torch.dtype]] = set()

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.written.add((key_states.dtype, value_states.dtype))
        return super().update(key_states.float(), value_states.float(), layer_idx, *args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_under_autocast_the_static_cache_samples_as_one_that_keeps_fp32_keys(
    checkpoints, arch, dtype, monkeypatch
):
    """A RoPE model under autocast writes fp32 keys beside low-precision values; the static cache
    stores the keys in the values' dtype, which attention casts them to anyway: the samples are
    those of a cache that keeps them in fp32, token for token. (Attention over the whole length
    of an untrimmed static cache, HF's own included, rounds otherwise in bf16: a rare token
    differed on a Qwen2 shape.)"""
    model = load_causal_lm(checkpoints[arch])
    gen = hf_generation_config(GenerationConfig(max_new_tokens=12, temperature=0.7), 1, 0)
    prompt = torch.randint(3, 20, (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(10)[None, :] >= torch.tensor([[0], [3], [5], [8]])  # left padding
    samples = {}
    for cache in (OneDtypeStaticCache, Fp32StaticCache):
        monkeypatch.setattr(rollout_module, "OneDtypeStaticCache", cache)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=dtype):
            samples[cache] = generate(model, prompt, mask, gen, "static")
    assert Fp32StaticCache.written == {(torch.float32, dtype)}  # the mixed writes the cache must take
    assert torch.equal(samples[OneDtypeStaticCache].response_ids, samples[Fp32StaticCache].response_ids)
    assert samples[Fp32StaticCache].response_mask.sum() > 4 * 3  # more than a token or two each
    Fp32StaticCache.written.clear()


@pytest.mark.parametrize("precision", ["transformer-engine", "transformer-engine-float16"])
def test_a_precision_the_package_cannot_serve_is_refused_saying_what_to_use(precision):
    with pytest.raises(UsageError, match=r"trainer.precision .*bf16-mixed"):
        check_precision(precision)


def test_16_true_is_refused_in_one_line_before_any_model_loads(capsys, tmp_path):
    """float16 weights and AdamW state: the quickstart's steps went NaN after three (AdamW's eps 1e-8
    is 0 in float16). Refused before the policy is even looked for: the folder named does not exist,
    and the error is the precision's, naming what to use instead."""
    args = quickstart_fit_args(tmp_path / "no-such-policy", tmp_path, [], "--trainer.precision", "16-true")
    message = cli_usage_error(capsys, args)
    assert message.startswith("trainer.precision '16-true' is not supported")
    assert "16-mixed" in message and "bf16-true" in message
    assert not (tmp_path / "checkpoints").exists()


def test_16_true_is_refused_by_the_python_api_before_training(tiny_gpt2):
    module = PPOLightningModule(str(tiny_gpt2), reward_fn=CountCharReward())
    trainer = quiet_trainer("unused", iterations=1, precision="16-true")
    with pytest.raises(UsageError, match=r"trainer.precision '16-true'.*16-mixed"):
        trainer.fit(module, datamodule=prompt_data(4))
    assert module.iteration == 0


@pytest.mark.parametrize("precision", [*PRECISIONS, "64-true", 32, "bf16", 16, None])
def test_the_precisions_that_run_pass_the_check(precision):
    check_precision(precision)
