"""Reward models score the last real token, whatever the padding; reward functions by class_path."""

from __future__ import annotations

import concurrent.futures
import signal
from functools import partial

import pytest
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from lightning_ppo import PPOLightningModule
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rewards import RewardModel
from tests.helpers import cli_usage_error, quickstart_fit_args

EOS = 1  # also the pad id below: HF's own pooling would look for the first pad and pick the wrong token


def test_reward_model_reads_the_last_real_token_with_pad_equal_eos(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=20, n_layer=2, n_embd=32, n_head=2, num_labels=1, pad_token_id=EOS, eos_token_id=EOS
    )
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    reward = RewardModel.from_pretrained(str(tmp_path))
    # Row 0: left-padded prompt, response "7 EOS" then padding (= EOS ids); row 1: no padding at all.
    rollout = Rollout(
        prompt_ids=torch.tensor([[EOS, 5, 6], [4, 5, 6]]),
        prompt_mask=torch.tensor([[False, True, True], [True, True, True]]),
        response_ids=torch.tensor([[7, EOS, EOS, EOS], [7, 8, 9, 10]]),
        response_mask=torch.tensor([[True, True, False, False], [True, True, True, True]]),
        ended=torch.tensor([True, False]),
    )
    scores = reward(rollout.input_ids, rollout.attention_mask, rollout.position_ids)
    # The same sequences scored alone, without any padding, by HF's own classifier.
    alone = [torch.tensor([[5, 6, 7, EOS]]), torch.tensor([[4, 5, 6, 7, 8, 9, 10]])]
    with torch.no_grad():
        expected = []
        for ids in alone:
            hidden = reward.model.transformer(input_ids=ids).last_hidden_state
            expected.append(reward.model.score(hidden[0, -1]).item())
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-5)
    assert all(not p.requires_grad for p in reward.parameters())


def _digits_module(policy, **kwargs):
    from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule

    ppo = PPOConfig(**kwargs.pop("ppo", {}))
    return PPOLightningModule(
        policy=str(policy), ppo=ppo, generation=GenerationConfig(max_new_tokens=6), **kwargs
    )


def _rollout_and_text(module, prompts):
    from lightning_ppo import PromptDataModule

    data = PromptDataModule(prompts=prompts, batch_size=len(prompts))
    data.set_tokenizer(module.tokenizer)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    rollout = module.generate(batch)
    return batch, rollout, module.decode_responses(rollout)


def test_reward_model_with_its_own_tokenizer_scores_the_decoded_text(tiny_gpt2, tiny_reward):
    from lightning_ppo.rewards import ScoreInputs

    torch.manual_seed(0)
    module = _digits_module(tiny_gpt2, reward_model=str(tiny_reward))
    own = module.reward_model.tokenizer
    assert own is not None and own.get_vocab() != module.tokenizer.get_vocab()
    batch, rollout, completions = _rollout_and_text(module, ["12=", "345=", "6="])
    scores = module.score(batch.prompts, completions, ScoreInputs(batch.extras, rollout))
    # the same text tokenised by the reward model's tokenizer, one sequence at a time, no padding
    expected = []
    for prompt, completion in zip(batch.prompts, completions, strict=True):
        ids = torch.tensor([own(prompt + completion)["input_ids"]])
        mask = torch.ones_like(ids, dtype=torch.bool)
        expected.append(module.reward_model(ids, mask, torch.arange(ids.shape[1])[None]).item())
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-5)


def test_reward_model_sharing_the_policy_vocabulary_skips_the_round_trip(tiny_digits, tmp_path):
    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tmp_path / "rm", TinyModelSpec(n_embd=32), alphabet="0123456789=", kind="reward"
    )
    module = _digits_module(tiny_digits, reward_model=str(path))
    assert module.reward_model.tokenizer is None


def test_weighted_rewards_sum_and_plain_functions(tiny_digits):
    from lightning_ppo.rewards import ScoreInputs
    from lightning_ppo.tasks.digits import DigitsReward, digits_score, exact_length

    torch.manual_seed(0)
    module = _digits_module(tiny_digits, reward_fn=[DigitsReward(), exact_length], reward_weights=[2.0, -1.0])
    batch, rollout, completions = _rollout_and_text(module, ["12345=", "67890="])
    batch.extras["target"] = ["12345", "67890"]
    scores = module.score(batch.prompts, completions, ScoreInputs(batch.extras, rollout))
    expected = [
        2.0 * digits_score(c, t) - float(len(c) == 5)
        for c, t in zip(completions, ["12345", "67890"], strict=True)
    ]
    assert scores.tolist() == pytest.approx(expected)


def test_reward_weights_must_match_the_rewards(tiny_digits):
    from lightning_ppo.tasks.digits import exact_length

    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 1 rewards"):
        _digits_module(tiny_digits, reward_fn=exact_length, reward_weights=[1.0, 2.0])


def nan_for_first(prompts, completions, batch):
    return [float("nan")] + [1.0] * (len(completions) - 1)


def test_nan_reward_raises_naming_the_reward_or_is_dropped_and_counted(tiny_digits):
    from lightning_ppo.rewards import ScoreInputs

    torch.manual_seed(0)
    strict = _digits_module(tiny_digits, reward_fn=nan_for_first)
    batch, rollout, completions = _rollout_and_text(strict, ["12=", "34="])
    with pytest.raises(ValueError, match="reward 'nan_for_first' returned NaN or inf at positions \\[0\\]"):
        strict.score(batch.prompts, completions, ScoreInputs(batch.extras, rollout))

    lenient = _digits_module(tiny_digits, reward_fn=nan_for_first, ppo={"on_bad_reward": "drop"})
    scores = lenient.score(batch.prompts, completions, ScoreInputs(batch.extras, rollout))
    shaped = lenient.shape_scores(scores, rollout)
    assert shaped.dropped.tolist() == [True, False]
    assert shaped.shaped.tolist() == [0.0, 1.0]
    assert not rollout.response_mask[0].any() and rollout.response_mask[1].any()


def test_wrong_length_reward_names_the_reward(tiny_digits):
    from lightning_ppo.rewards import ScoreInputs

    module = _digits_module(tiny_digits, reward_fn=lambda p, c, b: [1.0])
    batch, rollout, completions = _rollout_and_text(module, ["12=", "34="])
    with pytest.raises(
        ValueError, match="reward '<lambda>' must return one score per completion, shape \\(2,\\)"
    ):
        module.score(batch.prompts, completions, ScoreInputs(batch.extras, rollout))


def test_critic_free_estimator_holds_no_value_parameters(tiny_digits):
    from lightning_ppo.tasks.digits import exact_length

    module = _digits_module(
        tiny_digits, reward_fn=exact_length, ppo={"advantage_estimator": "grpo", "num_generations": 2}
    )
    assert module.value_model is None
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in module.policy.parameters())


def test_score_clip_and_running_normalisation(tiny_digits):
    from lightning_ppo.tasks.digits import exact_length

    module = _digits_module(tiny_digits, reward_fn=exact_length, ppo={"score_clip": 1.0, "score_norm": True})
    rollout = Rollout(
        prompt_ids=torch.zeros(4, 1, dtype=torch.long),
        prompt_mask=torch.ones(4, 1, dtype=torch.bool),
        response_ids=torch.ones(4, 2, dtype=torch.long),
        response_mask=torch.ones(4, 2, dtype=torch.bool),
        ended=torch.ones(4, dtype=torch.bool),
    )
    raw = torch.tensor([-5.0, 0.0, 1.0, 9.0])
    shaped = module.shape_scores(raw, rollout)
    clipped = torch.tensor([-1.0, 0.0, 1.0, 1.0])
    expected = (clipped - clipped.mean()) / clipped.var(unbiased=False).sqrt()
    assert torch.allclose(shaped.shaped, expected, atol=1e-5)
    assert torch.equal(shaped.raw, raw)  # what objective/scores and the sample table report


def test_reward_model_chat_template_wraps_prompt_and_completion(tiny_gpt2, tmp_path):
    from transformers import AutoTokenizer

    from lightning_ppo.rewards import ScoreInputs
    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tmp_path / "rm", TinyModelSpec(n_embd=32), alphabet="0123456789=:ua ", kind="reward"
    )
    template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }} {% endfor %}"
    own = AutoTokenizer.from_pretrained(path)
    own.chat_template = template
    own.save_pretrained(path)
    torch.manual_seed(0)
    module = _digits_module(tiny_gpt2, reward_model=str(path), reward_chat_template=True)
    batch, rollout, completions = _rollout_and_text(module, ["12=", "3="])
    scores = module.score(batch.prompts, completions, ScoreInputs(batch.extras, rollout))
    expected = []
    for prompt, completion in zip(batch.prompts, completions, strict=True):
        ids = torch.tensor([own(f"u:{prompt} a:{completion} ")["input_ids"]])
        expected.append(
            module.reward_model(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(ids.shape[1])[None])
        )
    assert torch.allclose(scores, torch.cat(expected), atol=1e-5)


def test_reward_chat_template_without_a_template_is_a_clear_error(tiny_gpt2, tiny_reward):
    with pytest.raises(ValueError, match="reward_chat_template"):
        _digits_module(tiny_gpt2, reward_model=str(tiny_reward), reward_chat_template=True)


def _ours(prompts, completions, batch):
    return [0.0] * len(completions)


def _trl(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def _trl_named_column(prompts, completions, answer, **kwargs):
    return [0.0] * len(completions)


def _ours_with_kwargs(prompts, completions, batch, **kwargs):
    return [0.0] * len(completions)


def _two_args(prompts, completions):
    return [0.0] * len(completions)


@pytest.mark.parametrize(
    ("fn", "trl"),
    [
        (_ours, False),
        (lambda p, c, b: [0.0], False),
        (_ours_with_kwargs, False),
        (_trl, True),
        (_trl_named_column, True),
        (lambda completions, **kw: [0.0], True),
        (_two_args, None),
        (lambda prompts, completions, batch, extra: [0.0], None),
    ],
)
def test_the_call_convention_is_read_from_the_signature(fn, trl):
    from lightning_ppo.rewards import uses_trl_convention

    assert uses_trl_convention(fn) is trl


def test_a_reward_with_a_wrong_signature_fails_before_any_model_loads(tmp_path):
    from lightning_ppo import PPOLightningModule

    # The policy path does not exist: the signature error must come first.
    with pytest.raises(TypeError) as info:
        PPOLightningModule(policy=str(tmp_path / "not-loaded"), reward_fn=_two_args)
    message = str(info.value)
    assert "reward_fn '_two_args' has the signature _two_args(prompts, completions)" in message
    assert "fn(prompts, completions, batch)" in message and "fn(prompts, completions, **kwargs)" in message


def test_trl_style_rewards_get_dataset_columns_and_completion_ids(tiny_gpt2, tmp_path):
    import json

    from lightning_ppo import PromptDataModule
    from tests.helpers import TRL_CALLS, TRLLengthReward, quiet_trainer, trl_answer_reward

    rows = [{"prompt": f"{i}{i + 1}=", "answer": str(i + 2)} for i in range(8)]
    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = PromptDataModule(data_files=str(data_file), batch_size=8, max_prompt_length=8)
    torch.manual_seed(0)
    module = _digits_module(tiny_gpt2, reward_fn=[trl_answer_reward, TRLLengthReward()])
    TRL_CALLS.clear()
    quiet_trainer(tmp_path, iterations=1).fit(module, datamodule=data)
    assert len(TRL_CALLS) == 2  # one call of each reward
    answers = {row["prompt"]: row["answer"] for row in rows}
    function_call, class_call = TRL_CALLS
    assert function_call["answer"] == [answers[p] for p in function_call["prompts"]]
    assert class_call["answer"] == function_call["answer"]
    ids = function_call["completion_ids"]
    assert len(ids) == 8 and all(isinstance(t, int) for row in ids for t in row)
    tokenizer = module.tokenizer
    for row, completion in zip(ids, function_call["completions"], strict=True):
        # cut right after the stop token, or all 6 tokens of a response that never stopped: no padding
        assert module.stop_token_id not in row[:-1]
        assert row[-1] == module.stop_token_id or len(row) == 6
        assert tokenizer.decode(row, skip_special_tokens=True) == completion


class _TorchScorer:
    """A plain ``torch.nn`` scorer called without ``no_grad``: its scores carry its graph."""

    def __init__(self) -> None:
        torch.manual_seed(3)
        self.head = torch.nn.Linear(1, 1)

    def __call__(self, prompts, completions, batch):
        lengths = torch.tensor([[float(len(c))] for c in completions])
        return self.head(lengths).squeeze(1)


def test_a_reward_returning_a_tensor_with_a_graph_is_detached_where_it_enters(tiny_digits, tmp_path):
    from lightning_ppo.rewards import check_scores
    from tests.helpers import prompt_data, quiet_trainer

    scorer = _TorchScorer()
    scores = scorer([], ["12", "345"], None)
    assert scores.requires_grad
    assert not check_scores(scores, 2, "scorer").requires_grad
    torch.manual_seed(0)
    module = _digits_module(tiny_digits, reward_fn=scorer, ppo={"ppo_epochs": 2, "num_minibatches": 2})
    # the second minibatch's backward would run through the reward's graph a second time
    quiet_trainer(tmp_path, iterations=1).fit(module, datamodule=prompt_data())
    assert module.trainer.global_step == 4
    assert scorer.head.weight.grad is None  # the update never reached the reward's parameters


@pytest.mark.parametrize("reward", ["exits_with_0", "exits_with_0_async"], ids=["def", "async def"])
def test_a_reward_that_exits_stops_the_run_in_one_line_with_status_2(reward, tiny_digits, tmp_path, capsys):
    """``sys.exit(0)`` inside a plain reward ended ``fit`` in silence with status 0, as if the run had
    finished; both kinds of reward now say so in the same line."""
    args = quickstart_fit_args(
        tiny_digits, tmp_path, [], "--model.init_args.reward_fn", f"tests.helpers.{reward}"
    )
    assert cli_usage_error(capsys, args) == (
        f"reward '{reward}' raised SystemExit(0): code that training calls must raise an exception, "
        "not exit; the run stops here"
    )


def test_a_keyboard_interrupt_from_a_plain_reward_is_a_ctrl_c(tiny_digits, tmp_path, capsys):
    """On the main thread a KeyboardInterrupt cannot be told from a Ctrl-C, which lands wherever the
    main thread is (often in a slow reward): it stays the run's Ctrl-C, one line and status 130."""
    from lightning_ppo.cli import main

    args = quickstart_fit_args(
        tiny_digits, tmp_path, [], "--model.init_args.reward_fn", "tests.helpers.raises_keyboard_interrupt"
    )
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores further Ctrl-Cs while shutting down
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "lightning-ppo: interrupted (Ctrl-C) during training; the checkpoints it had written are kept"
    )


def test_a_keyboard_interrupt_from_a_reward_off_the_main_thread_is_the_codes_own(tiny_digits):
    """No Ctrl-C lands off the main thread: there a reward's KeyboardInterrupt stops the run as an exit
    does (one line), where on the main thread it stays the Ctrl-C it may be."""
    from lightning_ppo.rewards import ScoreInputs
    from lightning_ppo.runs.bounded_calls import CallExited
    from tests.helpers import raises_keyboard_interrupt

    module = PPOLightningModule(policy=str(tiny_digits), reward_fn=raises_keyboard_interrupt)
    score = partial(module.score, ["1="], ["1"], ScoreInputs({}, None, None))
    with pytest.raises(KeyboardInterrupt):
        score()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with pytest.raises(
            CallExited, match=r"^reward 'raises_keyboard_interrupt' raised KeyboardInterrupt\(\)"
        ):
            pool.submit(score).result()


def finds_nothing(prompts, completions, batch):
    """``next()`` over no match, a common bug: it raises StopIteration."""
    return [next(c for c in completions if c == "never")] * len(completions)


def test_a_reward_raising_stop_iteration_is_an_error_not_the_end_of_the_data(tiny_digits, tmp_path):
    """Lightning's loop takes a StopIteration out of ``training_step`` for the end of the epoch: the
    run ended at once, as if done, with nothing trained. Now it is an error naming the reward."""
    from tests.helpers import prompt_data, quiet_trainer

    module = PPOLightningModule(policy=str(tiny_digits), reward_fn=finds_nothing)
    with pytest.raises(RuntimeError, match=r"^reward 'finds_nothing' raised StopIteration") as raised:
        quiet_trainer(tmp_path, iterations=2).fit(module, datamodule=prompt_data())
    assert isinstance(raised.value.__cause__, StopIteration) and module.iteration == 0
