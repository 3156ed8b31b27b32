"""Rollout masks: from the stop token's position, never from pad ids; generation matches forwards."""

from __future__ import annotations

import pytest
import torch

from lightning_ppo.config import GenerationConfig
from lightning_ppo.models.loading import load_causal_lm, response_logits
from lightning_ppo.ppo import functional as F
from lightning_ppo.ppo.rollout_data import position_ids_from_mask
from lightning_ppo.rollout.sampling import (
    cache_for,
    generate,
    hf_generation_config,
    truncate_at_stop,
)

EOS = PAD = 1  # pad == eos: the case that breaks masks built from `ids != pad_token_id`


def test_truncate_at_stop_with_pad_equal_eos():
    ids = torch.tensor([[5, 6, EOS, 7, 8], [5, 6, 7, 8, 9], [EOS, 5, EOS, 6, 7]])
    out_ids, mask, ended = truncate_at_stop(ids, stop_token_id=EOS, pad_token_id=PAD)
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, True],
        [True, False, False, False, False],
    ]
    assert ended.tolist() == [True, False, True]
    assert out_ids.tolist() == [[5, 6, EOS, PAD, PAD], [5, 6, 7, 8, 9], [EOS, PAD, PAD, PAD, PAD]]


def test_custom_stop_token_is_not_eos():
    ids = torch.tensor([[5, EOS, 9, 7], [5, 6, 7, 8]])
    _, mask, ended = truncate_at_stop(ids, stop_token_id=9, pad_token_id=0)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert ended.tolist() == [True, False]


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_forward_logprobs_equal_sampling_distribution(tiny_gpt2):
    """Log-probs recomputed by a forward over left-padded prompts equal generation's own scores."""
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_gpt2))
    config = GenerationConfig(max_new_tokens=6, temperature=0.7)
    gen = hf_generation_config(config, stop_token_id=1, pad_token_id=0)
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    prompt_mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    rollout = generate(model, prompt_ids, prompt_mask, gen)
    torch.manual_seed(0)  # the same draw again, this time keeping generation's scores
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask.long(),
            generation_config=gen,
            output_scores=True,
            return_dict_in_generate=True,
        )
        assert torch.equal(
            out.sequences[:, 4:][rollout.response_mask], rollout.response_ids[rollout.response_mask]
        )
        scores = torch.stack(out.scores, 1)[:, : rollout.response_ids.shape[1]]
        logits = response_logits(
            model,
            rollout.input_ids,
            rollout.attention_mask,
            rollout.position_ids,
            rollout.response_ids.shape[1],
        )
    # generation's scores are logits / temperature with no other processor applied
    assert torch.allclose(logits / 0.7, scores, atol=1e-4)
    logprobs = F.logprobs_from_logits(logits, rollout.response_ids, 0.7)
    expected = torch.log_softmax(scores, -1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-4)


def test_mixed_precision_generation_casts_once_and_leaves_no_stale_weights(tiny_gpt2):
    model = load_causal_lm(str(tiny_gpt2))
    gen = hf_generation_config(GenerationConfig(max_new_tokens=6), stop_token_id=1, pad_token_id=0)
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    prompt_mask = prompt_ids != 0
    # Lightning's bf16-mixed: one autocast without a cast cache around the whole training_step.
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        torch.manual_seed(0)
        cached = generate(model, prompt_ids, prompt_mask, gen)
        torch.manual_seed(0)
        with torch.no_grad():
            plain = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask.long(), generation_config=gen
            )
            before = model(input_ids=prompt_ids).logits
            for p in model.parameters():
                p.mul_(1.5)  # an optimizer step, in place, inside the same training_step
            after = model(input_ids=prompt_ids).logits
    # the same bf16 casts, once per generation instead of once per token: the same samples
    assert torch.equal(cached.response_ids[cached.response_mask], plain[:, 4:][cached.response_mask])
    # the forward after the update used the new weights, not casts cached during generation
    assert (after - before).abs().max() > 0.1
    with torch.no_grad():
        expected = model(input_ids=prompt_ids).logits  # fp32, new weights
    assert (after.float() - expected).abs().max() < 0.1 * expected.abs().max()


def test_suppressed_tokens_are_never_sampled_and_logprobs_use_the_same_mask(tiny_gpt2):
    """64 sampled responses hold no suppressed token, and the trainer's log-probs of the sampled
    tokens equal generation's processed scores (-inf on suppressed tokens, / temperature)."""
    from lightning_ppo import PPOLightningModule, PromptDataModule
    from tests.helpers import CountCharReward

    generation = GenerationConfig(max_new_tokens=8, temperature=0.7, suppress_tokens=["7", "a", 9])
    module = PPOLightningModule(policy=str(tiny_gpt2), reward_fn=CountCharReward(), generation=generation)
    suppressed = torch.tensor(module.suppressed_ids)
    assert module.tokenizer.convert_tokens_to_ids("7") in module.suppressed_ids and 9 in module.suppressed_ids
    data = PromptDataModule(prompts=["0"], batch_size=1)
    data.set_tokenizer(module.tokenizer)
    batch = data.make_batch([f"{i % 10}{(i * 3) % 10}=" for i in range(64)])
    torch.manual_seed(0)
    rollout = module.generate(batch)
    sampled = rollout.response_ids[rollout.response_mask]
    assert not torch.isin(sampled, suppressed).any()
    torch.manual_seed(0)  # the same draw again, keeping generation's processed scores
    with torch.no_grad():
        out = module.policy.generate(
            input_ids=batch.prompt_ids,
            attention_mask=batch.prompt_mask.long(),
            generation_config=module.hf_generation,
            output_scores=True,
            return_dict_in_generate=True,
        )
        forwards = module.rollout_forwards(rollout)
    scores = torch.stack(out.scores, 1)[:, : rollout.response_ids.shape[1]]
    assert torch.isinf(scores[..., suppressed]).all()
    expected = torch.log_softmax(scores, -1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)
    mask = rollout.response_mask
    assert torch.allclose(forwards.logprobs[mask], expected[mask], atol=1e-4)  # ratio == 1
    # the reference is read under the same mask: at the start it is the policy, so KL is 0
    assert torch.allclose(forwards.ref_logprobs, forwards.logprobs, atol=1e-5)
    assert torch.isfinite(forwards.entropy).all()
    # without suppression the same model does sample those tokens (the flag is what removes them)
    plain = hf_generation_config(GenerationConfig(max_new_tokens=8, temperature=0.7), module.stop_token_id, 0)
    torch.manual_seed(0)
    unsuppressed = generate(module.policy, batch.prompt_ids, batch.prompt_mask, plain)
    assert torch.isin(unsuppressed.response_ids[unsuppressed.response_mask], suppressed).any()


def test_an_unknown_suppressed_token_names_the_field(tiny_gpt2):
    import pytest

    from lightning_ppo import PPOLightningModule
    from tests.helpers import CountCharReward

    generation = GenerationConfig(suppress_tokens=["<not-a-token>"])
    with pytest.raises(ValueError, match="generation.suppress_tokens: '<not-a-token>' is not a single token"):
        PPOLightningModule(policy=str(tiny_gpt2), reward_fn=CountCharReward(), generation=generation)


def test_suppress_token_patterns_match_the_vocabulary_with_only_star_and_question_mark_as_wildcards(tmp_path):
    """`*` is any run of characters and `?` one; `[` is literal (fnmatch would read a character class),
    and a string that is a token of the vocabulary stays that token even when it holds a wildcard."""
    import pytest
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from lightning_ppo.models.loading import load_tokenizer, resolve_suppressed_tokens
    from lightning_ppo.runs.errors import UsageError

    unused = [f"[unused{i}]" for i in range(12)]
    words = ["[PAD]", "[UNK]", *unused, "u", "n", "s", "e", "d", "?", "*", "**", "a", "ab", "ba"]
    vocab = {word: i for i, word in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(
        tmp_path
    )
    tokenizer = load_tokenizer(str(tmp_path))

    def resolve(*tokens):
        return resolve_suppressed_tokens(tokenizer, list(tokens))

    assert resolve("[unused*]") == [vocab[w] for w in unused]  # not "u", "n", "s", "e", "d"
    assert resolve("[unused?]") == [vocab[f"[unused{i}]"] for i in range(10)]
    assert resolve("?") == [vocab["?"]] and resolve("*") == [vocab["*"]] and resolve("**") == [vocab["**"]]
    expected = sorted([vocab["a"], vocab["ab"], 2, vocab["[unused10]"], vocab["[unused11]"]])
    assert resolve("a*", 2, "[unused1?]") == expected  # patterns, ids and tokens together
    with pytest.raises(
        UsageError, match=r"generation.suppress_tokens: pattern '\[nothing\*\]' matches no token"
    ):
        resolve("[unused*]", "[nothing*]")
    with pytest.raises(UsageError, match="suppresses every token of the vocabulary"):
        resolve("?*")


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt2-lora"])
def test_a_static_cache_samples_as_the_dynamic_one_at_each_call_s_own_length(arch, request, monkeypatch):
    """The default static cache changes the cost of generation, not what it samples; each call's
    cache holds its own prompt + max_new_tokens (HF's cache_implementation="static" would keep the
    longest call's length for every later call)."""
    from peft import LoraConfig, get_peft_model

    import lightning_ppo.rollout.sampling as rollout_module

    model = load_causal_lm(str(request.getfixturevalue("tiny_llama" if arch == "llama" else "tiny_gpt2")))
    if arch.endswith("lora"):
        model = get_peft_model(model, LoraConfig(r=4, init_lora_weights=False))
    made = []
    monkeypatch.setattr(rollout_module, "cache_for", lambda *a: made.append(cache_for(*a)) or made[-1])
    gen = hf_generation_config(GenerationConfig(max_new_tokens=12, temperature=0.7), 1, 0)
    long_prompt = torch.randint(3, 20, (4, 30), generator=torch.Generator().manual_seed(0))
    long_mask = torch.arange(30)[None, :] >= torch.tensor([[0], [9], [17], [25]])  # left padding
    for ids, mask in ((long_prompt, long_mask), (long_prompt[:, -6:], long_mask[:, -6:])):
        samples = {}
        for cache in ("dynamic", "static"):
            torch.manual_seed(1)
            samples[cache] = generate(model, ids, mask, gen, cache)
        assert torch.equal(samples["static"].response_ids, samples["dynamic"].response_ids)
        assert samples["static"].response_mask.sum() > 4 * 3  # more than a token or two each: a real test
        (static,) = made[-1].values()
        assert static.layers[0].keys.shape[2] == ids.shape[1] + 12  # this call's length, not the longest
    assert [bool(m) for m in made] == [False, True, False, True]  # dynamic: HF makes its own


def test_a_generate_that_fails_leaves_the_model_in_the_mode_it_found(tiny_gpt2):
    """Generation runs in eval mode; one that raises (here an id past the vocabulary, as a caught
    out-of-memory or an interrupt would) still puts a model in training mode back in it."""
    model = load_causal_lm(str(tiny_gpt2)).train()
    gen = hf_generation_config(GenerationConfig(max_new_tokens=2), stop_token_id=1, pad_token_id=0)
    prompt_ids = torch.tensor([[5, model.config.vocab_size + 7]])
    with pytest.raises(IndexError):
        generate(model, prompt_ids, torch.ones_like(prompt_ids, dtype=torch.bool), gen)
    assert model.training
