"""TRL's users' datasets and rewards: conversational prompts, TRL's reward-function convention in full
(None rows, async, catch-all signatures, trainer_state, log_metric/log_extra, partials) and reward
models in the reward_fn list. Real tiny checkpoints loaded by path; no mocks."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from lightning_ppo.checkpoint import frozen_names
from lightning_ppo.cli import main
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint
from tests.helpers import TRL_CALLS

# Role initial, colon, content, space; "a:" opens the assistant's turn. Only characters of the tiny
# checkpoints' default alphabet.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2 x 64 GPT-2 whose char tokenizer has a chat template, saved with the checkpoint."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("chat_policy"), TinyModelSpec(n_layer=2, n_embd=64))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def _conversations(path: Path, count: int = 8) -> list[dict]:
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}{i + 1}="}], "answer": str((i + 2) % 10)}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def _fit_config(tmp_path: Path, policy: Path, data_file: Path, reward_fn: list, **ppo) -> Path:
    """A two-iteration CPU run: GRPO, 2 completions per prompt, CSV log and a sample table each iteration."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 1,
            "limit_train_batches": 2,
            "log_every_n_steps": 1,
            "enable_model_summary": False,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "default_root_dir": str(tmp_path),
            "logger": [
                {
                    "class_path": "lightning.pytorch.loggers.CSVLogger",
                    "init_args": {"save_dir": str(tmp_path), "name": "csv"},
                }
            ],
            "callbacks": [
                {"class_path": "lightning_ppo.callbacks.SampleTable", "init_args": {"every_n_iterations": 1}}
            ],
        },
        "model": {
            "class_path": "lightning_ppo.PPOLightningModule",
            "init_args": {
                "policy": str(policy),
                "reward_fn": reward_fn,
                "ppo": {"advantage_estimator": "grpo", "num_generations": 2, "ppo_epochs": 1, **ppo},
                "generation": {"max_new_tokens": 4},
                "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}},
            },
        },
        "data": {
            "class_path": "lightning_ppo.PromptDataModule",
            "init_args": {"data_files": str(data_file), "batch_size": 4, "max_prompt_length": 16},
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _csv_rows(cli) -> list[dict]:
    return list(csv.DictReader((Path(cli.trainer.logger.log_dir) / "metrics.csv").open()))


def test_conversational_data_end_to_end_through_the_cli(chat_policy, tmp_path):
    """TRL's conversational prompt-only data: the template is applied (no chat_template: true set),
    a TRL reward gets the messages and assistant-message completions, ours the templated text."""
    rows = _conversations(tmp_path / "chat.jsonl")
    config = _fit_config(
        tmp_path,
        chat_policy,
        tmp_path / "chat.jsonl",
        ["tests.helpers.trl_chat_reward", "tests.helpers.text_chat_reward"],
    )
    TRL_CALLS.clear()
    cli = main(["fit", "--config", str(config)])
    assert len(TRL_CALLS) == 4  # two rewards, two iterations
    trl, ours = TRL_CALLS[0], TRL_CALLS[1]
    conversations = {json.dumps(row["prompt"]): row["answer"] for row in rows}
    assert len(trl["prompts"]) == 8  # 4 prompts x 2 completions
    assert all(json.dumps(p) in conversations for p in trl["prompts"])
    assert trl["answer"] == [conversations[json.dumps(p)] for p in trl["prompts"]]
    assert trl["prompts"][0] == trl["prompts"][1]  # the group of a prompt stays together
    assert [c[0]["content"] for c in trl["completions"]] == ours["completions"]
    assert all(c == [{"role": "assistant", "content": c[0]["content"]}] for c in trl["completions"])
    assert ours["messages"] == trl["prompts"]
    assert ours["text"] == [f"u:{p[0]['content']} a:" for p in trl["prompts"]]
    log = _csv_rows(cli)
    assert len(log) == 2 and all(row["objective/scores"] != "" for row in log)
    samples = sorted(Path(cli.trainer.logger.log_dir).rglob("samples/iteration_*.jsonl"))
    assert json.loads(samples[-1].read_text().splitlines()[0])["prompt"].startswith("u:")


# ----------------------------------------------------------------- TRL's reward convention, one form each
def _module(policy, reward_fn, **kwargs):
    from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule

    ppo = PPOConfig(**kwargs.pop("ppo", {}))
    return PPOLightningModule(
        policy=str(policy),
        reward_fn=reward_fn,
        ppo=ppo,
        generation=GenerationConfig(max_new_tokens=4),
        **kwargs,
    )


def _scored(module, prompts, repeat: int = 1):
    """A batch of ``prompts`` (each ``repeat`` times), its rollout, completions and the module's scores."""
    from lightning_ppo import PromptDataModule
    from lightning_ppo.rewards import ScoreInputs

    data = PromptDataModule(prompts=prompts, batch_size=len(prompts), shuffle=False)
    data.set_tokenizer(module.tokenizer)
    data.setup("fit")
    batch = next(iter(data.train_dataloader())).repeat_interleave(repeat)
    rollout = module.generate(batch)
    completions = module.decode_responses(rollout)
    inputs = ScoreInputs(batch.extras, rollout, batch.messages)
    return rollout, completions, module.score(batch.prompts, completions, inputs)


def trl_length(completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def catch_all(*args, **kwargs):
    return [float(len(c)) for c in kwargs["completions"]]


def keywords_only(**kwargs):
    return [1.0] * len(kwargs["prompts"])


@pytest.mark.parametrize("fn", [trl_length, catch_all, keywords_only])
def test_sync_trl_rewards_and_catch_all_signatures_are_called_with_trl_keywords(fn, tiny_gpt2):
    from lightning_ppo.rewards import uses_trl_convention

    assert uses_trl_convention(fn) is True
    torch.manual_seed(0)
    module = _module(tiny_gpt2, fn)
    rollout, completions, scores = _scored(module, ["12=", "34="])
    expected = {
        trl_length: [float(len(ids)) for ids in rollout.episode_token_ids()],
        catch_all: [float(len(c)) for c in completions],
        keywords_only: [1.0, 1.0],
    }[fn]
    assert scores.tolist() == expected


def none_for_odd_rows(completions, **kwargs):
    return [1.0 if i % 2 == 0 else None for i in range(len(completions))]


# Two rewards over 8 completions (2 prompts x 4): each leaves some rows out; row 7 is left out by both.
FIRST = [1.0, 2.0, 3.0, 4.0, None, None, None, None]
SECOND = [None, None, 1.0, 1.0, 0.5, 1.5, 4.0, None]


def first_scores(completions, **kwargs):
    return list(FIRST)


def second_scores(prompts, completions, batch):  # our convention may return None too
    return list(SECOND)


def test_none_rows_leave_a_reward_out_and_a_row_no_reward_scores_leaves_its_group(tiny_gpt2):
    from lightning_ppo.ppo.experience import estimate_advantages, last_token_index

    torch.manual_seed(0)
    grpo = {"advantage_estimator": "grpo", "num_generations": 4}  # on_bad_reward stays "error"
    module = _module(tiny_gpt2, [first_scores, second_scores], reward_weights=[1.0, 2.0], ppo=grpo)
    rollout, _, scores = _scored(module, ["12=", "34="], repeat=4)
    expected = [1.0, 2.0, 3.0 + 2.0, 4.0 + 2.0, 1.0, 3.0, 8.0]
    assert scores[:7].tolist() == expected and scores[7].isnan()
    shaped = module.shape_scores(scores, rollout)  # no error: a None is "not applicable", not a fault
    assert shaped.dropped.tolist() == [False] * 7 + [True]
    assert not rollout.response_mask[7].any()
    rewards = torch.zeros(rollout.response_mask.shape)
    rewards[torch.arange(8), last_token_index(rollout.response_mask)] = shaped.shaped
    advantages, _ = estimate_advantages(rewards, torch.zeros_like(rewards), rollout.response_mask, module.ppo)
    second_group = torch.tensor([1.0, 3.0, 8.0])  # row 7 is not in its group's mean and std
    normalised = (second_group - second_group.mean()) / (second_group.std() + 1e-6)
    kept = advantages[4:7, 0]
    assert torch.allclose(kept, normalised, atol=1e-5)
    assert advantages[7].eq(0).all()


def nan_for_first(completions, **kwargs):
    return [float("nan")] + [None] * (len(completions) - 1)


def test_a_nan_is_still_an_error_beside_none_rows(tiny_gpt2):
    torch.manual_seed(0)
    module = _module(tiny_gpt2, nan_for_first)
    with pytest.raises(ValueError, match=r"reward 'nan_for_first' returned NaN or inf at positions \[0\]"):
        _scored(module, ["12=", "34="])
    # a subclass that adds a NaN of its own to rows a reward scored is caught when the total is checked
    module = _module(tiny_gpt2, none_for_odd_rows)
    rollout, _, scores = _scored(module, ["12=", "34="])
    assert scores[1].isnan()
    with pytest.raises(ValueError, match=r"returned NaN or inf at positions \[0\]"):
        module.shape_scores(torch.tensor([float("nan"), float("nan")]), rollout)


def test_unscored_rows_are_counted_and_warned_about_once(tiny_gpt2):
    from tests.helpers import fit_warnings, prompt_data

    torch.manual_seed(0)
    module = _module(tiny_gpt2, none_for_odd_rows)
    messages = fit_warnings(module, prompt_data(batch_size=4), iterations=2)
    warned = [m for m in messages if "scored by no reward" in m]
    assert warned == [
        "2 of 4 completions were scored by no reward (every reward returned None for them): they are left "
        "out of the update and of their group's baseline, and counted in reward/unscored (this warning is "
        "shown once)"
    ]
    metrics = module.trainer.callback_metrics
    assert metrics["reward/unscored"] == 2 and metrics["reward/dropped"] == 2


HANDSHAKE: dict[str, object] = {}
LOOPS: list[object] = []


async def _meet(mine: str, other: str) -> None:
    import asyncio

    HANDSHAKE.setdefault(mine, asyncio.Event()).set()
    other_event = HANDSHAKE.setdefault(other, asyncio.Event())
    await asyncio.wait_for(other_event.wait(), timeout=10)  # run one after the other, they would time out


async def async_first(completions, **kwargs):
    import asyncio

    LOOPS.append(asyncio.get_running_loop())
    await _meet("first", "second")
    return [1.0] * len(completions)


class AsyncSecond:
    """An async reward as a callable class (TRL's convention), awaited concurrently with the first."""

    async def __call__(self, prompts, completions, **kwargs):
        await _meet("second", "first")
        return [2.0] * len(completions)


def test_async_rewards_run_concurrently_on_one_loop_even_from_a_running_loop(tiny_gpt2):
    import asyncio
    import threading

    torch.manual_seed(0)
    module = _module(tiny_gpt2, [async_first, AsyncSecond(), trl_length], reward_weights=[1.0, 10.0, 0.0])
    HANDSHAKE.clear()
    LOOPS.clear()
    assert _scored(module, ["12=", "34="])[2].tolist() == [21.0, 21.0]

    async def inside_a_running_loop():  # as in a notebook, whose kernel runs an event loop
        HANDSHAKE.clear()
        return _scored(module, ["12=", "34="])[2].tolist()

    assert asyncio.run(inside_a_running_loop()) == [21.0, 21.0]
    results = []

    def in_a_thread():
        HANDSHAKE.clear()
        results.append(_scored(module, ["12="])[2].tolist())

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert results == [[21.0]]
    assert len(LOOPS) == 3 and LOOPS[0] is LOOPS[1] is LOOPS[2]  # one loop for the whole process


STATES: list[object] = []


def progress(completions, trainer_state, log_metric, log_extra, **kwargs):
    """Scores by the run's progress, logs a metric (twice: the mean is logged) and a table column."""
    STATES.append(trainer_state)
    log_metric("length_mean", sum(len(c) for c in completions) / len(completions))
    log_metric("length_mean", 0.0)
    log_extra("length", [len(c) for c in completions])
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


def test_trainer_state_log_metric_and_log_extra(tiny_gpt2, tmp_path):
    import lightning.pytorch as pl

    from lightning_ppo.callbacks import SampleTable
    from lightning_ppo.watch.samples import read_samples
    from tests.helpers import prompt_data

    torch.manual_seed(0)
    STATES.clear()
    module = _module(tiny_gpt2, [progress, trl_length], reward_weights=[1.0, 0.0], ppo={"num_minibatches": 1})
    # outside a Trainer: the iteration, nothing known about the run's length
    assert _scored(module, ["12="])[2].tolist() == [-0.0]
    assert STATES.pop().max_steps == -1
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=3,
        max_steps=3 * 4,  # 3 iterations of ppo_epochs (4) x num_minibatches (1) optimizer steps
        limit_train_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[SampleTable(every_n_iterations=1)],
    )
    trainer.fit(module, datamodule=prompt_data(batch_size=4))
    steps = [(s.global_step, s.max_steps, s.epoch, s.num_train_epochs) for s in STATES]
    assert steps == [(0, 3, 0.0, 3), (1, 3, 0.5, 3), (2, 3, 1.0, 3)]
    last = module.last_samples
    assert trainer.callback_metrics["reward/length_mean"] == pytest.approx(
        sum(len(c) for c in last.completions) / len(last.completions) / 2
    )
    assert last.extra == {"length": [len(c) for c in last.completions]}
    rows = read_samples(sorted(tmp_path.rglob("samples/iteration_*.jsonl"))[-1])
    assert [row["length"] for row in rows] == [len(c) for c in last.completions]


def scaled(completions, scale=1.0, **kwargs):
    return [scale * len(c) for c in completions]


def test_partials_are_named_apart(tiny_gpt2):
    from functools import partial

    from lightning_ppo.tasks.digits import exact_length
    from tests.helpers import prompt_data, quiet_trainer

    torch.manual_seed(0)
    rewards = [partial(scaled, scale=2), partial(scaled, scale=3), exact_length, exact_length]
    module = _module(tiny_gpt2, rewards)
    names = [call.name for call in module.reward_calls]
    assert names == ["scaled_scale=2", "scaled_scale=3", "exact_length", "exact_length_2"]
    quiet_trainer(tiny_gpt2, iterations=1).fit(module, datamodule=prompt_data(batch_size=4))
    logged = {key for key in module.trainer.callback_metrics if key.startswith("reward/")}
    assert {f"reward/{name}" for name in names} <= logged


# ----------------------------------------------------------------- reward models in the reward_fn list
def test_a_reward_model_path_and_a_loaded_model_in_the_list_are_weighted_in_list_order(
    tiny_gpt2, tiny_reward, tmp_path
):
    from transformers import AutoModelForSequenceClassification

    from lightning_ppo.rewards import RewardModel
    from lightning_ppo.tasks.digits import exact_length

    # one with the policy's vocabulary (scores the token ids), one with its own (the decoded text)
    same_vocab = make_tiny_checkpoint(tmp_path / "same_vocab_rm", TinyModelSpec(n_embd=32), kind="reward")
    loaded = AutoModelForSequenceClassification.from_pretrained(same_vocab)
    torch.manual_seed(0)
    module = _module(
        tiny_gpt2,
        [str(tiny_reward), exact_length, loaded],
        reward_weights=[2.0, 1.0, -1.0],
    )
    assert [call.name for call in module.reward_calls] == [tiny_reward.name, "exact_length", "same_vocab_rm"]
    listed = [module.reward_fn_0, module.reward_fn_2]  # submodules: moved with the module, frozen
    assert listed[1].model is loaded and listed[1].tokenizer is None  # shares the policy's vocabulary
    assert listed[0].tokenizer is not None  # the digits vocabulary: text round trip
    assert not any(p.requires_grad for reward in listed for p in reward.parameters())
    assert all(name not in module.state_dict() or True for name in ())
    rollout, completions, scores = _scored(module, ["12=", "34="])
    by_path = RewardModel.from_pretrained(str(tiny_reward), module.tokenizer)
    by_model = RewardModel(loaded)
    prompts = ["12=", "34="]
    expected = (
        2.0 * by_path.score(prompts, completions, rollout)
        + torch.tensor([float(len(c) == 5) for c in completions])
        - by_model(rollout.input_ids, rollout.attention_mask, rollout.position_ids)
    )
    assert torch.allclose(scores, expected, atol=1e-5)
    frozen = frozen_names(module)
    assert any(name.startswith("reward_fn_2.") for name in frozen)  # left out of checkpoints


def test_a_reward_model_path_in_the_list_through_the_cli(tiny_digits, tiny_reward, tmp_path):
    from tests.helpers import PROMPTS

    data_file = tmp_path / "prompts.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rewards = [str(tiny_reward), "lightning_ppo.tasks.digits.exact_length"]
    cli = main(["fit", "--config", str(_fit_config(tmp_path, tiny_digits, data_file, rewards))])
    assert [call.name for call in cli.model.reward_calls] == [tiny_reward.name, "exact_length"]
    log = _csv_rows(cli)
    assert len(log) == 2 and log[-1][f"reward/{tiny_reward.name}"] != ""


def test_reward_fn_strings_and_models_that_are_not_rewards_are_named(tiny_gpt2, tmp_path):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from lightning_ppo.runs.errors import UsageError

    # both before any model loads (the policy path does not exist)
    with pytest.raises(
        UsageError, match="reward_fn 'my_rewards.nope' is neither a reward model's folder nor"
    ):
        _module(tmp_path / "not-loaded", "my_rewards.nope")
    for missing in ("./missing", str(tmp_path / "missing")):
        with pytest.raises(FileNotFoundError, match=f"reward_fn '{missing}': no such reward model folder"):
            _module(tmp_path / "not-loaded", missing)
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(UsageError, match="weights.bin' is a file; expected a reward model's folder"):
        _module(tmp_path / "not-loaded", str(tmp_path / "weights.bin"))
    two_labels = GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=32, n_head=2, num_labels=2))
    with pytest.raises(
        UsageError, match="reward model 'GPT2ForSequenceClassification' has 2 labels; a reward"
    ):
        _module(tiny_gpt2, two_labels)


def test_a_reward_model_with_its_own_chat_template_scores_the_conversation(chat_policy, tmp_path):
    """Conversational data and a reward model with a tokenizer (and chat template) of its own: the
    conversation plus the reply as the assistant's message, in its template, as TRL scores it."""
    path = make_tiny_checkpoint(
        tmp_path / "rm", TinyModelSpec(n_embd=32), alphabet="0123456789=:usa ", kind="reward"
    )
    own = AutoTokenizer.from_pretrained(path)
    own.chat_template = "{% for m in messages %}{{ m['role'][0] }}={{ m['content'] }}:{% endfor %}"
    own.save_pretrained(path)
    torch.manual_seed(0)
    module = _module(chat_policy, [str(path)])
    conversation = [{"role": "system", "content": "0"}, {"role": "user", "content": "12="}]
    rollout, completions, scores = _scored(module, [conversation])
    reward = module.reward_fn_0
    ids = torch.tensor([own(f"s=0:u=12=:a={completions[0]}:")["input_ids"]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    assert torch.allclose(scores, reward(ids, mask, torch.arange(ids.shape[1])[None]), atol=1e-5)
