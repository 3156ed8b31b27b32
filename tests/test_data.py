"""Tests for lightning_ppo.data, offline, on a per-character tokenizer built in tmp_path."""

from __future__ import annotations

import csv
import json
import logging
import re
import warnings

import datasets
import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from jsonargparse import ArgumentParser
from lightning.fabric.utilities.apply_func import move_data_to_device
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightning_ppo.data import PromptBatch, PromptDataModule, ResumableSampler, collate_prompts

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 :=?.,+")
VOCAB = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + CHARS)}
PAD, EOS = 0, 1
# Role initial, colon, content, space; ends with the generation prompt "a:". Only vocab characters.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def save_tokenizer(path, **special) -> str:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    chat_template = special.pop("chat_template", None)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **special)
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """Keep the Arrow files `datasets` writes for local files out of the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")


@pytest.fixture
def tok_path(tmp_path) -> str:
    return save_tokenizer(tmp_path / "tok", eos_token="<eos>", pad_token="<pad>", chat_template=CHAT_TEMPLATE)


def make_dm(tok_path: str, **kwargs) -> PromptDataModule:
    kwargs.setdefault("shuffle", False)
    dm = PromptDataModule(tokenizer=tok_path, **kwargs)
    dm.setup("fit")
    return dm


def first_batch(dm: PromptDataModule) -> PromptBatch:
    return next(iter(dm.train_dataloader()))


def test_tokenizer_fixture_splits_per_character(tok_path):
    tok = AutoTokenizer.from_pretrained(tok_path)
    assert tok("ab c?")["input_ids"] == ids("ab c?")
    assert tok.decode(ids("ab c?")) == "ab c?"
    assert (tok.pad_token_id, tok.eos_token_id) == (PAD, EOS)


def test_in_memory_prompts_left_padded(tok_path):
    dm = make_dm(tok_path, prompts=["ab", "abcd", "c"], batch_size=3)
    batch = first_batch(dm)
    assert isinstance(batch, PromptBatch) and len(batch) == 3
    assert batch.prompt_ids.dtype == torch.long and batch.prompt_mask.dtype == torch.bool
    assert batch.prompt_ids.tolist() == [[PAD, PAD, 3, 4], [3, 4, 5, 6], [PAD, PAD, PAD, 5]]
    assert batch.prompt_mask.tolist() == [
        [False, False, True, True],
        [True, True, True, True],
        [False, False, False, True],
    ]
    assert batch.prompts == ["ab", "abcd", "c"]
    assert batch.extras == {}


def test_mask_from_lengths_when_pad_is_eos(tmp_path):
    path = save_tokenizer(tmp_path / "tok_eos", eos_token="<eos>", pad_token="<eos>")
    # The first prompt starts with a real eos token, which equals the pad id.
    dm = make_dm(path, prompts=["<eos>ab", "abcd"], batch_size=2)
    batch = first_batch(dm)
    assert batch.prompt_ids.tolist() == [[EOS, EOS, 3, 4], [3, 4, 5, 6]]
    assert batch.prompt_mask.tolist() == [[False, True, True, True], [True, True, True, True]]


def test_collate_usable_directly(tok_path):
    dm = make_dm(tok_path, prompts=["ab"], batch_size=1)
    rows = [
        {"input_ids": [7], "prompt": "x", "extras": {"answer": 1}},
        {"input_ids": torch.tensor([8, 9, 10]), "prompt": "y", "extras": {"answer": 2}},
    ]
    batch = dm.collate(rows)
    assert batch.prompt_ids.tolist() == [[PAD, PAD, 7], [8, 9, 10]]
    assert batch.prompt_mask.tolist() == [[False, False, True], [True, True, True]]
    assert batch.prompts == ["x", "y"] and batch.extras == {"answer": [1, 2]}
    assert collate_prompts(rows, pad_token_id=-1).prompt_ids[0, 0].item() == -1
    with pytest.raises(ValueError, match="empty"):
        dm.collate([])


def test_move_data_to_device_keeps_dataclass(tok_path):
    dm = make_dm(tok_path, prompts=["ab", "c"], batch_size=2)
    batch = dm.make_batch(["ab", "c"], extras={"answer": ["x", "y"]})
    moved = move_data_to_device(batch, "cpu")
    assert isinstance(moved, PromptBatch)
    assert torch.equal(moved.prompt_ids, batch.prompt_ids)
    assert torch.equal(moved.prompt_mask, batch.prompt_mask)
    assert moved.prompts == ["ab", "c"] and moved.extras == {"answer": ["x", "y"]}


def test_left_truncation_keeps_last_tokens(tok_path, caplog):
    caplog.set_level(logging.WARNING, logger="lightning_ppo.data")
    dm = make_dm(tok_path, prompts=["abcdef", "xyz", "0123456"], batch_size=3, max_prompt_length=3)
    batch = first_batch(dm)
    assert batch.prompt_ids.tolist() == [ids("def"), ids("xyz"), ids("456")]
    assert batch.prompt_mask.all()
    assert batch.prompts == ["def", "xyz", "456"]  # the text the policy sees: what rewards get
    warnings = [r.getMessage() for r in caplog.records if "max_prompt_length" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("2 of 3 train prompts")


def write_rows(path, rows: list[dict]) -> None:
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        pd.DataFrame(rows).to_parquet(path)


ROWS = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "what is 3", "answer": "3"}]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_local_files_pass_extras_through(tok_path, tmp_path, suffix):
    rows = [{"prompt": "ab", "answer": "x"}, {"prompt": "cde", "answer": "y"}]
    path = tmp_path / f"prompts{suffix}"
    write_rows(path, rows)
    dm = make_dm(tok_path, data_files=str(path), batch_size=2)
    batch = first_batch(dm)
    assert batch.prompt_ids.tolist() == [[PAD] + ids("ab"), ids("cde")]
    assert batch.prompts == ["ab", "cde"]
    assert batch.extras == {"answer": ["x", "y"]}


def test_data_files_dict_with_val_split(tok_path, tmp_path):
    write_rows(tmp_path / "train.jsonl", [{"prompt": p} for p in ["ab", "cd", "ef"]])
    write_rows(tmp_path / "val.jsonl", [{"prompt": "zz"}])
    files = {"train": str(tmp_path / "train.jsonl"), "validation": str(tmp_path / "val.jsonl")}
    dm = make_dm(tok_path, data_files=files, val_split="validation", batch_size=2)
    assert len(dm.train_dataset) == 3
    val = list(dm.val_dataloader())
    assert len(val) == 1 and val[0].prompt_ids.tolist() == [ids("zz")]
    with pytest.raises(ValueError, match=r"data.val_split 'test' not found.*\['train', 'validation'\]"):
        make_dm(tok_path, data_files=files, val_split="test", batch_size=2)


def test_chat_template_applied(tok_path):
    dm = make_dm(tok_path, prompts=["hi"], batch_size=1, chat_template=True, system_prompt="be")
    batch = first_batch(dm)
    assert batch.prompts == ["s:be u:hi a:"]
    assert batch.prompt_ids.tolist() == [ids("s:be u:hi a:")]
    no_system = make_dm(tok_path, prompts=["hi"], batch_size=1, chat_template=True)
    assert first_batch(no_system).prompts == ["u:hi a:"]


def test_chat_template_missing_names_tokenizer(tmp_path):
    path = save_tokenizer(tmp_path / "plain_tok", eos_token="<eos>", pad_token="<pad>")
    with pytest.raises(ValueError, match=r"plain_tok.*no chat template"):
        make_dm(path, prompts=["hi"], batch_size=1, chat_template=True)
    with pytest.raises(ValueError, match="data.system_prompt needs data.chat_template: true"):
        PromptDataModule(tokenizer=path, prompts=["hi"], system_prompt="be")


def _conversation(text: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "user", "content": text}]
    return messages if system is None else [{"role": "system", "content": system}, *messages]


def test_conversational_prompts_get_the_chat_template_and_keep_their_messages(tok_path, tmp_path):
    """TRL's conversational prompt-only format: the template applies without chat_template: true,
    with its generation prompt and no special tokens added; the messages reach the batch as given."""
    rows = [
        {"prompt": _conversation("hi", system="be"), "answer": "x"},
        {"prompt": _conversation("yo"), "answer": "y"},
        {"prompt": [], "answer": "blank"},  # no message: dropped like a blank text prompt
    ]
    write_rows(tmp_path / "chat.jsonl", rows)
    dm = make_dm(tok_path, data_files=str(tmp_path / "chat.jsonl"), batch_size=2)
    batch = first_batch(dm)
    assert batch.prompts == ["s:be u:hi a:", "u:yo a:"]
    assert batch.prompt_ids[1].tolist() == [PAD] * 5 + ids("u:yo a:")
    assert batch.messages == [rows[0]["prompt"], rows[1]["prompt"]]
    assert batch.extras == {"answer": ["x", "y"]}
    twice = batch.repeat_interleave(2)
    assert twice.messages == [rows[0]["prompt"]] * 2 + [rows[1]["prompt"]] * 2
    # a system prompt opens the conversations that have none of their own
    with_system = make_dm(
        tok_path, data_files=str(tmp_path / "chat.jsonl"), batch_size=2, chat_template=True, system_prompt="s"
    )
    assert first_batch(with_system).prompts == ["s:be u:hi a:", "s:s u:yo a:"]
    made = dm.make_batch([_conversation("ab")], extras={"answer": ["z"]})
    assert made.prompts == ["u:ab a:"] and made.messages == [_conversation("ab")]
    assert dm.make_batch(["ab"]).messages is None  # text prompts carry no messages


def test_conversational_prompts_without_a_chat_template_or_mixed_with_text_are_refused(tok_path, tmp_path):
    plain = save_tokenizer(tmp_path / "plain_tok", eos_token="<eos>", pad_token="<pad>")
    with pytest.raises(ValueError, match=r"^tokenizer '.*plain_tok' has no chat template, which the train"):
        make_dm(plain, prompts=[_conversation("hi")], batch_size=1)
    given = r"^row 2 of the given prompts: data.prompt_column 'prompt' holds conversations .* str"
    with pytest.raises(ValueError, match=given):
        make_dm(tok_path, prompts=["hi"], batch_size=1).make_batch([_conversation("hi"), "hi"])
    write_rows(tmp_path / "n.jsonl", [{"prompt": 3}])
    in_file = re.escape(repr(str(tmp_path / "n.jsonl")))
    with pytest.raises(
        ValueError, match=rf"^{in_file} line 1: .* must hold strings or conversations .* got int"
    ):
        make_dm(tok_path, data_files=str(tmp_path / "n.jsonl"), batch_size=1)


def test_missing_column_lists_present_columns(tok_path, tmp_path):
    path = tmp_path / "p.jsonl"
    write_rows(path, [{"question": "ab", "answer": "x"}])
    with pytest.raises(ValueError, match=r"'prompt' not found.*\['question', 'answer'\]"):
        make_dm(tok_path, data_files=str(path), batch_size=1)
    dm = make_dm(tok_path, data_files=str(path), batch_size=1, prompt_column="question")
    assert first_batch(dm).extras == {"answer": ["x"]}


def test_source_count_errors(tok_path, tmp_path):
    with pytest.raises(ValueError, match=r"exactly one.*\['data.dataset_name', 'data.prompts'\]"):
        PromptDataModule(tokenizer=tok_path, prompts=["a"], dataset_name="x")
    with pytest.raises(ValueError, match=r"exactly one.*data_files.*got none"):
        PromptDataModule(tokenizer=tok_path)
    with pytest.raises(ValueError, match="at most one of data.val_split"):
        PromptDataModule(tokenizer=tok_path, prompts=["a"], val_split="v", val_size=2)


def test_file_errors_name_the_file(tok_path, tmp_path):
    bad = tmp_path / "prompts.txt"
    bad.write_text("ab\n")
    with pytest.raises(ValueError, match=r"prompts\.txt"):
        make_dm(tok_path, data_files=str(bad))
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        make_dm(tok_path, data_files=[str(tmp_path / "nope.jsonl")])
    write_rows(tmp_path / "a.csv", ROWS)
    write_rows(tmp_path / "b.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"mixes formats \['csv', 'json'\]"):
        make_dm(tok_path, data_files=[str(tmp_path / "a.csv"), str(tmp_path / "b.jsonl")])


def test_non_string_prompt_names_row_and_type(tok_path, tmp_path):
    path = tmp_path / "p.jsonl"
    write_rows(path, [{"prompt": "ab"}, {"prompt": None}])
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(str(path)))} line 2: .* got NoneType"):
        make_dm(tok_path, data_files=str(path), batch_size=1)

    class IntPrompts(PromptDataModule):
        def load_dataset(self):
            return datasets.Dataset.from_dict({"prompt": [5, 6]})

    with pytest.raises(ValueError, match=r"^row 1 of the train split: .* got int"):
        IntPrompts(tokenizer=tok_path, batch_size=1).setup("fit")


def test_batch_larger_than_dataset(tok_path):
    with pytest.raises(ValueError, match=r"has 3 prompts, fewer than data.batch_size 4"):
        make_dm(tok_path, prompts=["a", "b", "c"], batch_size=4)
    dm = make_dm(tok_path, prompts=["a", "b", "c"], batch_size=4, drop_last=False)
    assert len(first_batch(dm)) == 3


def test_whitespace_prompts_dropped(tok_path, caplog):
    caplog.set_level(logging.WARNING, logger="lightning_ppo.data")
    dm = make_dm(tok_path, prompts=["ab", "  ", "", "c"], batch_size=2)
    assert first_batch(dm).prompts == ["ab", "c"]
    assert any("dropped 2 empty or whitespace-only" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="no non-empty prompts"):
        make_dm(tok_path, prompts=[" ", "\n"], batch_size=1)


def test_missing_pad_token_uses_eos(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="lightning_ppo.data")
    path = save_tokenizer(tmp_path / "nopad", eos_token="<eos>")
    dm = make_dm(path, prompts=["ab", "c"], batch_size=2)
    assert dm.tokenizer.pad_token == "<eos>" and dm.pad_token_id == EOS
    assert first_batch(dm).prompt_ids.tolist() == [ids("ab"), [EOS] + ids("c")]
    assert any("no pad token" in r.getMessage() for r in caplog.records)
    bare = save_tokenizer(tmp_path / "bare")
    with pytest.raises(ValueError, match="neither a pad token nor an eos token"):
        make_dm(bare, prompts=["ab"], batch_size=1)


def epoch_orders(dm: PromptDataModule, epochs: int = 2) -> list[list[str]]:
    loader = dm.train_dataloader()
    orders = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)  # as Lightning does at the start of every epoch
        orders.append([p for batch in loader for p in batch.prompts])
    return orders


def test_sampler_resumes_mid_epoch_and_shards_by_rank(tok_path):
    prompts = [f"p{i}" for i in range(16)]
    dm = make_dm(tok_path, prompts=prompts, batch_size=2, shuffle=True, seed=3)
    loader = dm.train_dataloader()
    full = [batch.prompts for batch in loader]
    done = [3]
    loader.sampler.batches_done = lambda: done[0]  # a Trainer's progress, read at each epoch's start
    assert [batch.prompts for batch in loader] == full[3:]
    done[0] = 0
    assert [batch.prompts for batch in loader] == full  # a new epoch starts at its beginning
    shards = [list(ResumableSampler(dm.train_dataset, 2, 2, rank, shuffle=True, seed=3)) for rank in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 8 and not set(shards[0]) & set(shards[1])


def test_seeded_shuffle_reproducible(tok_path):
    prompts = [f"p{i}" for i in range(20)]
    first = epoch_orders(make_dm(tok_path, prompts=prompts, batch_size=4, shuffle=True, seed=3))
    again = epoch_orders(make_dm(tok_path, prompts=prompts, batch_size=4, shuffle=True, seed=3))
    other = epoch_orders(make_dm(tok_path, prompts=prompts, batch_size=4, shuffle=True, seed=4))
    assert first == again
    assert first != other
    assert first[0] != first[1]  # a new order each epoch
    assert sorted(first[0]) == sorted(prompts) and first[0] != prompts


def test_val_size_holds_out_train(tok_path):
    prompts = [f"p{i}" for i in range(10)]
    dm = make_dm(tok_path, prompts=prompts, val_size=0.2, batch_size=2)
    train, val = dm.train_dataset.prompts, dm.val_dataset.prompts
    assert len(train) == 8 and len(val) == 2
    assert sorted(train + val) == sorted(prompts)
    batches = list(dm.val_dataloader())
    assert [p for b in batches for p in b.prompts] == val
    same = make_dm(tok_path, prompts=prompts, val_size=0.2, batch_size=2)
    assert same.val_dataset.prompts == val
    counted = make_dm(tok_path, prompts=prompts, val_size=3, batch_size=2)
    assert len(counted.val_dataset) == 3 and len(counted.train_dataset) == 7


def test_val_prompts_and_no_val(tok_path):
    dm = make_dm(tok_path, prompts=["ab", "cd"], val_prompts=["e", "fg", "h"], batch_size=2)
    batches = list(dm.val_dataloader())
    assert [len(b) for b in batches] == [2, 1]
    assert batches[0].prompt_ids.tolist() == [[PAD] + ids("e"), ids("fg")]
    assert make_dm(tok_path, prompts=["ab"], batch_size=1).val_dataloader() == []


def test_subclass_and_set_tokenizer(tok_path):
    class Synthetic(PromptDataModule):
        def load_dataset(self):
            return datasets.Dataset.from_dict({"prompt": ["1+2=", "3+4="], "answer": [3, 7]})

    dm = Synthetic(batch_size=2, shuffle=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        dm.setup("fit")
    dm.set_tokenizer(AutoTokenizer.from_pretrained(tok_path))
    dm.setup("fit")
    batch = first_batch(dm)
    assert batch.prompt_ids[0, -1].item() == VOCAB["="] and batch.extras == {"answer": [3, 7]}
    with pytest.raises(RuntimeError, match="setup"):
        Synthetic(tokenizer=tok_path).train_dataloader()


class _Consumer(pl.LightningModule):
    """Checks the batches Lightning hands to the steps."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[int] = []

    def training_step(self, batch: PromptBatch, batch_idx: int) -> torch.Tensor:
        assert isinstance(batch, PromptBatch) and batch.prompt_ids.shape == batch.prompt_mask.shape
        self.seen.append(len(batch))
        return (self.weight * batch.prompt_mask.sum()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_consumes_batches(tok_path):
    dm = PromptDataModule(tokenizer=tok_path, prompts=["ab", "c", "de", "f", "g"], batch_size=2)
    model = _Consumer()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    assert model.seen == [2, 2]


def test_val_size_from_cli_parses_as_row_count(tok_path):
    parser = ArgumentParser()
    parser.add_class_arguments(PromptDataModule, "data")
    assert parser.parse_args(["--data.val_size=3"]).data.val_size == 3
    assert parser.parse_args(["--data.val_size=0.25"]).data.val_size == 0.25
    dm = PromptDataModule(tokenizer=tok_path, prompts=["a"] * 10, val_size=3.0)
    assert dm.val_size == 3 and isinstance(dm.val_size, int)
    with pytest.raises(ValueError, match="below 1"):
        PromptDataModule(tokenizer=tok_path, prompts=["a"], val_size=1.5)


def test_workers_give_same_batches(tok_path):
    prompts = [f"p{i}" for i in range(12)]
    solo = epoch_orders(make_dm(tok_path, prompts=prompts, batch_size=3, shuffle=True, seed=1), epochs=1)
    pooled = make_dm(tok_path, prompts=prompts, batch_size=3, shuffle=True, seed=1, num_workers=2)
    assert epoch_orders(pooled, epochs=1) == solo


def test_dataset_saved_to_disk_and_hparams(tok_path, tmp_path):
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["ab", "c"], "n": [1, 2]})})
    saved.save_to_disk(str(tmp_path / "saved"))
    dm = make_dm(tok_path, dataset_name=str(tmp_path / "saved"), batch_size=2)
    assert first_batch(dm).extras == {"n": [1, 2]}
    in_memory = PromptDataModule(tokenizer=tok_path, prompts=["ab"], batch_size=1)
    assert "prompts" not in in_memory.hparams and in_memory.hparams.tokenizer == tok_path


def save_wordpiece_policy(path) -> str:
    """A BERT-style WordPiece tokenizer (it adds ``[CLS] ... [SEP]``, no EOS) and a tiny GPT-2 on it."""
    from tokenizers import processors
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "##s"])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    )
    hf.save_pretrained(path)
    config = GPT2Config(vocab_size=len(vocab), n_layer=1, n_embd=16, n_head=2, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def test_add_special_tokens_option_and_the_prompt_ending_with_the_stop_token_warning(tmp_path):
    from lightning_ppo import GenerationConfig, PPOLightningModule
    from tests.helpers import CountCharReward

    path = save_wordpiece_policy(tmp_path / "wordpiece")
    generation = GenerationConfig(max_new_tokens=2, stop_token="[SEP]")
    module = PPOLightningModule(policy=path, reward_fn=CountCharReward(), generation=generation)
    prompts = ["the cat sat", "the cats"]
    default = make_dm(path, prompts=prompts, batch_size=2)  # today's behaviour: special tokens added
    assert [row["input_ids"] for row in default.train_dataset] == [[2, 4, 5, 6, 3], [2, 4, 5, 7, 3]]
    with pytest.warns(UserWarning, match="prompts end with the stop token '\\[SEP\\]'") as record:
        module.generate(first_batch(default))
        module.generate(first_batch(default))
    assert len([w for w in record if "stop token" in str(w.message)]) == 1  # once per run
    plain = make_dm(path, prompts=prompts, batch_size=2, add_special_tokens=False)
    assert [row["input_ids"] for row in plain.train_dataset] == [[4, 5, 6], [4, 5, 7]]
    quiet = PPOLightningModule(policy=path, reward_fn=CountCharReward(), generation=generation)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.generate(first_batch(plain))
