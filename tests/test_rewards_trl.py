"""TRL's users' datasets and rewards: conversational prompts. Real tiny checkpoints loaded by path;
no mocks."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

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
