"""Prompt data for PPO: load prompts, tokenize them once, and serve left-padded batches.

PPO only needs prompts (the policy writes the responses), so a batch is the tokenized prompts plus
whatever other columns the dataset has (reference answers, task metadata) for the reward function.

A prompt is text, or a conversation as TRL's conversational datasets hold it: a list of
``{"role": ..., "content": ...}`` messages, which always goes through the tokenizer's chat template
(with the generation prompt); there is no other way to turn a message list into the policy's text.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import datasets
import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_ppo.rollout.prompts import PromptBatch
from lightning_ppo.rollout.tools import PromptTools
from lightning_ppo.rollout.vocab import check_representable
from lightning_ppo.runs.data_files import RowOrigin, find_problem
from lightning_ppo.runs.errors import MissingPathError, UsageError
from lightning_ppo.runs.quiet import exact_mid_epoch_resume

log = logging.getLogger(__name__)

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# Suffixes `datasets` decompresses on the fly, so "x.jsonl.gz" is still a json file.
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst")
_TOKENIZE_CHUNK = 1024
# A column added before the val_size shuffle: each row's number in its split as loaded (for messages).
_ROW = "__lightning_ppo_row__"


@rank_zero_only
def _warn(message: str) -> None:
    """Log a warning once per job rather than once per rank."""
    log.warning(message)


class ResumableSampler(DistributedSampler):
    """A seeded, rank-aware sampler that can start mid-epoch.

    It is a ``DistributedSampler`` even on one process: Lightning leaves such a sampler in place
    under DDP (each rank reads its own shard) and calls ``set_epoch`` every epoch, so the order is
    a pure function of ``seed``, epoch and rank. Each epoch starts after ``batches_done()`` batches
    (0 outside a Trainer): the Trainer's count of the current epoch's batches already trained on,
    so a resumed run sees exactly the prompts it would have.
    """

    def __init__(
        self, dataset: Dataset, batch_size: int, num_replicas: int = 1, rank: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, **kwargs)
        self.batch_size = batch_size
        self.batches_done: Callable[[], int] = lambda: 0

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.batches_done() * self.batch_size :])


class PromptRows(Dataset):
    """Tokenized prompts held as plain lists; each item is a row for :func:`collate_prompts`.

    Args:
        input_ids: token ids of each prompt, already truncated, unpadded.
        prompts: prompt text of each row.
        extras: other columns, each a list with one value per row.
        messages: the conversation of each row (conversational data), else ``None``.
    """

    def __init__(
        self,
        input_ids: list[list[int]],
        prompts: list[str],
        extras: dict[str, list],
        messages: list[list[dict[str, Any]]] | None = None,
    ) -> None:
        self.input_ids = input_ids
        self.prompts = prompts
        self.extras = extras
        self.messages = messages

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = {
            "input_ids": self.input_ids[index],
            "prompt": self.prompts[index],
            "extras": {name: values[index] for name, values in self.extras.items()},
        }
        if self.messages is not None:
            row["messages"] = self.messages[index]
        return row


def collate_prompts(rows: Sequence[Mapping[str, Any]], pad_token_id: int) -> PromptBatch:
    """Left-pad rows to the longest prompt in the batch.

    Args:
        rows: mappings with ``input_ids`` (list of ints or 1-D tensor), ``prompt`` (str), an optional
            ``extras`` mapping (column name -> value) and, for conversational data, ``messages``.
        pad_token_id: id written into the padding positions.

    Returns:
        The batch; ``prompt_mask`` is derived from the row lengths.
    """
    if not rows:
        raise ValueError("cannot collate an empty list of rows")
    lengths = [len(row["input_ids"]) for row in rows]
    width = max(lengths)
    # Padded as Python lists, then one tensor each: a copy per row would be a few ops per row.
    ids = [[pad_token_id] * (width - len(row["input_ids"])) + _token_list(row["input_ids"]) for row in rows]
    prompt_ids = torch.tensor(ids, dtype=torch.long)
    prompt_mask = torch.tensor([[False] * (width - n) + [True] * n for n in lengths], dtype=torch.bool)
    names = list(rows[0].get("extras", {}))
    extras = {name: [row["extras"][name] for row in rows] for name in names}
    messages = [row["messages"] for row in rows] if "messages" in rows[0] else None
    return PromptBatch(prompt_ids, prompt_mask, [row["prompt"] for row in rows], extras, messages)


def _token_list(ids: Any) -> list[int]:
    """A row's token ids as a list of ints (a dataset may hold a list or a 1-D tensor)."""
    return ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]


def is_conversation(prompt: Any) -> bool:
    """Whether a prompt is a conversation: a list of messages, each a mapping with a ``role``."""
    return isinstance(prompt, (list, tuple)) and all(
        isinstance(message, Mapping) and isinstance(message.get("role"), str) for message in prompt
    )


def _is_blank(prompt: str | Sequence[Mapping[str, Any]]) -> bool:
    """An empty or whitespace-only prompt; a conversation with no message or only empty contents."""
    if isinstance(prompt, str):
        return not prompt.strip()
    return not any(not isinstance(m.get("content"), str) or m["content"].strip() for m in prompt)


def _as_file_list(data_files: str | Sequence[str] | Mapping[str, Any]) -> list[str]:
    """Flatten the forms `datasets` accepts for ``data_files`` into one list of paths."""
    if isinstance(data_files, str):
        return [data_files]
    values = list(data_files.values()) if isinstance(data_files, Mapping) else list(data_files)
    files: list[str] = []
    for value in values:
        files.extend([value] if isinstance(value, str) else value)
    return files


def _builder_for_file(path: str) -> str:
    """Return the `datasets` builder name for a file, from its extension."""
    stem = path.lower()
    for suffix in _COMPRESSION:
        stem = stem.removesuffix(suffix)
    builder = _BUILDERS.get(os.path.splitext(stem)[1])
    if builder is None:
        raise UsageError(
            f"cannot infer the format of data file {path!r}: expected one of {sorted(_BUILDERS)}"
        )
    return builder


def _check_exists(path: str) -> None:
    """Fail early, naming the file, instead of deep inside `datasets`; URLs are left to `datasets`."""
    if "://" in path:
        return
    if any(ch in path for ch in "*?["):
        if not glob.glob(path, recursive=True):
            raise MissingPathError(f"no data file matches the pattern {path!r}")
    elif not os.path.isfile(path):
        raise MissingPathError(f"data file not found: {path!r}")


def infer_builder(data_files: str | Sequence[str] | Mapping[str, Any]) -> str:
    """Check that every data file exists and that all share one format; return that format's builder.

    Args:
        data_files: a path, a list of paths, or a mapping split name -> path(s).

    Returns:
        ``"json"``, ``"csv"`` or ``"parquet"``.
    """
    files = _as_file_list(data_files)
    if not files:
        raise UsageError("data.data_files is empty")
    builders = set()
    for path in files:
        builders.add(_builder_for_file(path))
        _check_exists(path)
    if len(builders) > 1:
        raise UsageError(f"data.data_files mixes formats {sorted(builders)}; use files of a single format")
    return builders.pop()


class PromptDataModule(pl.LightningDataModule):
    """Prompts for PPO from local files, a `datasets` hub/disk dataset, or an in-memory list.

    Prompts are validated and tokenized once in :meth:`setup`; dataloaders yield :class:`PromptBatch`.
    Subclasses that generate prompts in code (synthetic tasks) override :meth:`load_dataset`.

    Args:
        tokenizer: path or hub name passed to ``AutoTokenizer.from_pretrained``; usually linked to the
            policy's path. Leave None when the tokenizer is given with :meth:`set_tokenizer`.
        data_files: local json/jsonl/csv/parquet file(s): a path, a list of paths, or a mapping
            split name -> path. The format is inferred from the extension.
        dataset_name: name (or local directory) of a dataset for ``datasets.load_dataset``; a directory
            written by ``save_to_disk`` is read with ``datasets.load_from_disk``.
        dataset_config: configuration name of ``dataset_name``.
        prompts: prompts given in memory. Exactly one of ``data_files``, ``dataset_name`` and
            ``prompts`` must be set, unless a subclass overrides :meth:`load_dataset`.
        prompt_column: column holding the prompts: text, or conversations as in TRL's conversational
            datasets (``[{"role": "user", "content": ...}, ...]``, rendered with the tokenizer's chat
            template and its generation prompt whatever ``chat_template`` says). All other columns
            are passed through as ``PromptBatch.extras``.
        train_split: split used for training.
        val_split: split used for validation, if the dataset has one.
        val_size: hold out this part of the train split for validation: a fraction in (0, 1) or a
            number of rows; 0 disables it.
        val_prompts: validation prompts given in memory. At most one of ``val_split``, ``val_size``
            and ``val_prompts`` may be set.
        chat_template: wrap each text prompt as a user message with the tokenizer's chat template and
            add the generation prompt (conversations always get the template).
        add_special_tokens: let the tokenizer add its special tokens to each prompt (BOS, or BERT-style
            ``[CLS] ... [SEP]``); ``None``: yes, unless ``chat_template`` (the template writes them).
            A prompt must not end with the stop token: the policy would read it as "already stopped".
        system_prompt: system message placed before each prompt (a conversation that opens with a
            system message keeps its own); needs ``chat_template``.
        max_prompt_length: longer prompts keep only their last ``max_prompt_length`` tokens.
        batch_size: prompts per batch (per device).
        num_workers: dataloader worker processes.
        shuffle: shuffle the training prompts each epoch.
        seed: seed of the shuffling and of the ``val_size`` hold-out.
        drop_last: drop the last incomplete training batch, so PPO always sees full batches.
        trust_remote_code: allow custom tokenizer code (and, with ``datasets`` < 4, dataset scripts).
        tool_preamble: with ``model.tools`` in the ``text`` format, write a line per tool and how to
            call one before each text prompt (``PromptTools.preamble``). Tools in the ``hermes``
            format are always described: the chat template writes their schemas.
    """

    def __init__(
        self,
        tokenizer: str | None = None,
        data_files: str | list[str] | dict[str, str] | None = None,
        dataset_name: str | None = None,
        dataset_config: str | None = None,
        prompts: list[str] | list[list[dict[str, Any]]] | None = None,
        prompt_column: str = "prompt",
        train_split: str = "train",
        val_split: str | None = None,
        val_size: int | float = 0,
        val_prompts: list[str] | list[list[dict[str, Any]]] | None = None,
        chat_template: bool = False,
        add_special_tokens: bool | None = None,
        system_prompt: str | None = None,
        max_prompt_length: int = 128,
        batch_size: int = 16,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        trust_remote_code: bool = False,
        tool_preamble: bool = False,
    ) -> None:
        super().__init__()
        # In-memory prompt lists would bloat checkpoints and logged configs.
        self.save_hyperparameters(ignore=["prompts", "val_prompts"])
        self.data_files = data_files
        self.dataset_name = dataset_name
        self.dataset_config = dataset_config
        self.prompts = prompts
        self.prompt_column = prompt_column
        self.train_split = train_split
        self.val_split = val_split
        self.val_size = val_size
        self.val_prompts = val_prompts
        self.chat_template = chat_template
        self.add_special_tokens = add_special_tokens
        self.system_prompt = system_prompt
        self.tool_preamble = tool_preamble
        # the module's tools (PPOLightningModule.prompt_tools), taken in setup as the tokenizer is
        self.tools: PromptTools | None = None
        self.max_prompt_length = max_prompt_length
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.trust_remote_code = trust_remote_code
        self.train_dataset: PromptRows | None = None
        self.val_dataset: PromptRows | None = None
        self._tokenizer_name = tokenizer
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._check_args()

    def _check_args(self) -> None:
        """Reject inconsistent arguments at construction, before any loading."""
        sources = {
            "data.data_files": self.data_files,
            "data.dataset_name": self.dataset_name,
            "data.prompts": self.prompts,
        }
        given = [name for name, value in sources.items() if value is not None]
        # Subclasses that override load_dataset generate their own prompts and need no source.
        if len(given) > 1 or (not given and type(self).load_dataset is PromptDataModule.load_dataset):
            raise UsageError(f"give exactly one prompt source of {sorted(sources)}; got {given or 'none'}")
        self.val_size = self._check_val_size(self.val_size)
        val_given = [
            name
            for name, value in (("data.val_split", self.val_split), ("data.val_prompts", self.val_prompts))
            if value is not None
        ] + (["data.val_size"] if self.val_size else [])
        if len(val_given) > 1:
            raise UsageError(
                f"give at most one of data.val_split, data.val_size and data.val_prompts; got {val_given}"
            )
        if self.system_prompt is not None and not self.chat_template:
            raise UsageError("data.system_prompt needs data.chat_template: true")
        for name in ("max_prompt_length", "batch_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"data.{name} must be at least 1, got {getattr(self, name)}")

    @staticmethod
    def _check_val_size(val_size: int | float) -> int | float:
        """Return ``val_size`` as a fraction in [0, 1) or a whole row count."""
        if isinstance(val_size, bool) or val_size < 0:
            raise UsageError(f"data.val_size must be a fraction in (0, 1) or a row count, got {val_size!r}")
        if isinstance(val_size, float) and val_size >= 1:
            # Some parsers and YAML files turn 3 into 3.0; a whole number still means a row count.
            if not val_size.is_integer():
                raise UsageError(f"a fractional data.val_size must be below 1, got {val_size}")
            return int(val_size)
        return val_size

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, loaded from the ``tokenizer`` path on first use."""
        if self._tokenizer is None:
            if self._tokenizer_name is None:
                raise UsageError("no tokenizer: set data.tokenizer (a path or name), or call set_tokenizer()")
            loaded = AutoTokenizer.from_pretrained(
                self._tokenizer_name, trust_remote_code=self.trust_remote_code
            )
            self.set_tokenizer(loaded)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: PreTrainedTokenizerBase | str) -> None:
        self.set_tokenizer(tokenizer)

    def set_tokenizer(self, tokenizer: PreTrainedTokenizerBase | str) -> None:
        """Use this tokenizer (an object, or a path loaded lazily); data already set up is re-tokenized.

        Args:
            tokenizer: a tokenizer object, or a path/name for ``AutoTokenizer.from_pretrained``.
        """
        self.train_dataset = self.val_dataset = None
        if isinstance(tokenizer, str):
            self._tokenizer_name, self._tokenizer = tokenizer, None
            return
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise UsageError(
                    f"tokenizer {tokenizer.name_or_path!r} has neither a pad token nor an eos token; "
                    "set tokenizer.pad_token first"
                )
            # Safe because PromptBatch masks come from lengths, never from comparing ids to pad.
            tokenizer.pad_token = tokenizer.eos_token
            _warn(f"tokenizer {tokenizer.name_or_path!r} has no pad token; using eos {tokenizer.eos_token!r}")
        self._tokenizer = tokenizer

    @property
    def pad_token_id(self) -> int:
        """Id used to left-pad prompts."""
        return self.tokenizer.pad_token_id

    def load_dataset(self) -> datasets.DatasetDict | datasets.Dataset:
        """Load the raw prompts; override to generate prompts in code.

        Returns:
            A ``DatasetDict`` (splits chosen by ``train_split``/``val_split``) or a single ``Dataset``
            used as the train split. It must have the ``prompt_column``.
        """
        if self.prompts is not None:
            return datasets.Dataset.from_dict({self.prompt_column: list(self.prompts)})
        if self.data_files is not None:
            return self._load_files(self.data_files)
        if self.dataset_name is None:
            raise UsageError("no prompt source: set one of data.data_files, data.dataset_name, data.prompts")
        if os.path.isdir(self.dataset_name) and any(
            os.path.isfile(os.path.join(self.dataset_name, name))
            for name in ("dataset_dict.json", "state.json")
        ):
            return datasets.load_from_disk(self.dataset_name)
        # datasets>=4 ignores trust_remote_code but logs an error when it is passed as True.
        extra = {"trust_remote_code": True} if self.trust_remote_code else {}
        try:
            return datasets.load_dataset(self.dataset_name, self.dataset_config, **extra)
        except (ConnectionError, FileNotFoundError) as err:  # no network, no such dataset: one line
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UsageError(
                f"data.dataset_name {self.dataset_name!r} (data.dataset_config {self.dataset_config!r}) "
                f"could not be loaded: {first}; without the hub, save its splits where the run can read "
                "them and give data.data_files (a mapping split -> file)"
            ) from err

    @staticmethod
    def _load_files(data_files: str | list[str] | dict[str, str]) -> datasets.DatasetDict:
        """Load local files; a malformed or empty one is reported by name, not as a `datasets` error."""
        builder = infer_builder(data_files)
        verbosity = datasets.logging.get_verbosity()
        # datasets also logs each failure as an error line: the exception below says it once.
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)
        try:
            return datasets.load_dataset(builder, data_files=data_files)
        except Exception as err:  # datasets raises several types, StopIteration among them
            problem = find_problem(_as_file_list(data_files), builder)
            if problem is None:
                raise
            raise UsageError(problem) from err
        finally:
            datasets.logging.set_verbosity(verbosity)

    def prepare_data(self) -> None:
        """Download the tokenizer and a hub dataset on one process, so the other ranks read the cache."""
        if self._tokenizer is None and self._tokenizer_name is not None:
            AutoTokenizer.from_pretrained(self._tokenizer_name, trust_remote_code=self.trust_remote_code)
        if self.dataset_name is not None:
            self.load_dataset()

    def setup(self, stage: str | None = None) -> None:
        """Load, validate and tokenize the prompts; later calls reuse the result.

        Args:
            stage: Lightning stage ("fit", "validate", ...); all stages share the same data.
        """
        if self.train_dataset is not None:
            return
        if self._tokenizer is None and self._tokenizer_name is None:
            # Under a Trainer the module already loaded the policy's tokenizer: share it.
            module_tokenizer = (
                getattr(self.trainer.lightning_module, "tokenizer", None) if self.trainer else None
            )
            if module_tokenizer is not None:
                self.set_tokenizer(module_tokenizer)
        if self.tools is None and self.trainer is not None:  # the module's tools, described in the prompts
            self.tools = getattr(self.trainer.lightning_module, "prompt_tools", None)
        tokenizer = self.tokenizer
        if self.chat_template and not getattr(tokenizer, "chat_template", None):
            raise UsageError(
                f"data.chat_template is true but tokenizer {tokenizer.name_or_path!r} has no chat template"
            )
        train, val = self._split(self.load_dataset())
        train_rows = self._build_rows(train, self.train_split, self._origin(self.train_split))
        val_name = self.val_split or "validation"
        val_rows = None if val is None else self._build_rows(val, val_name, self._val_origin())
        if self.drop_last and len(train_rows) < self.batch_size:
            raise UsageError(
                f"the train set has {len(train_rows)} prompts, fewer than data.batch_size "
                f"{self.batch_size}, so data.drop_last: true would leave no batch; lower data.batch_size "
                "or set data.drop_last: false"
            )
        # Assigned only once everything is valid, so a failed setup is not mistaken for a finished one.
        self.train_dataset, self.val_dataset = train_rows, val_rows

    def _split(
        self, raw: datasets.DatasetDict | datasets.Dataset
    ) -> tuple[datasets.Dataset, datasets.Dataset | None]:
        """Pick the train and validation sets out of what :meth:`load_dataset` returned."""
        if isinstance(raw, datasets.DatasetDict):
            train = self._get_split(raw, self.train_split, "data.train_split")
        elif isinstance(raw, datasets.Dataset):
            if self.val_split is not None:
                raise UsageError(f"data.val_split {self.val_split!r} given but the dataset has no splits")
            train = raw
        else:
            raise TypeError(f"load_dataset() must return a Dataset or DatasetDict, got {type(raw).__name__}")
        if self.val_prompts is not None:
            return train, datasets.Dataset.from_dict({self.prompt_column: list(self.val_prompts)})
        if self.val_split is not None:
            return train, self._get_split(raw, self.val_split, "data.val_split")
        if self.val_size:
            # Shuffled apart: each row keeps its number in the split as loaded, for messages.
            numbered = train.add_column(_ROW, list(range(len(train))))
            held = numbered.train_test_split(test_size=self.val_size, shuffle=True, seed=self.seed)
            return held["train"], held["test"]
        return train, None

    def _origin(self, split: str) -> RowOrigin:
        """Where the rows of ``split`` (as :meth:`load_dataset` returned it) came from."""
        if type(self).load_dataset is not PromptDataModule.load_dataset:  # prompts made in code
            return RowOrigin(f"the {split} split")
        if self.prompts is not None:
            return RowOrigin("data.prompts")
        if self.data_files is not None:
            files = self.data_files
            if isinstance(files, Mapping):  # one entry per split; otherwise every file is "train"
                files = files.get(split, [])
            paths = _as_file_list(files)
            return RowOrigin("data.data_files", tuple(paths), _builder_for_file(paths[0]) if paths else "")
        return RowOrigin(f"the {split} split of data.dataset_name {self.dataset_name!r}")

    def _val_origin(self) -> RowOrigin:
        if self.val_prompts is not None:
            return RowOrigin("data.val_prompts")
        return self._origin(self.val_split or self.train_split)  # val_size: rows held out of the train split

    @staticmethod
    def _get_split(raw: datasets.DatasetDict, name: str, field: str) -> datasets.Dataset:
        if name not in raw:
            raise UsageError(f"{field} {name!r} not found; the dataset has splits {sorted(raw)}")
        return raw[name]

    def _build_rows(self, dataset: datasets.Dataset, split: str, origin: RowOrigin) -> PromptRows:
        """Validate one split, drop blank prompts, then format, tokenize and left-truncate; a bad row
        is named by ``origin`` (its file and line)."""
        if self.prompt_column not in dataset.column_names:
            raise UsageError(
                f"data.prompt_column {self.prompt_column!r} not found in the {split} split; "
                f"columns present: {dataset.column_names}"
            )
        columns = dataset.to_dict()
        raw_prompts = columns.pop(self.prompt_column)
        numbers = columns.pop(_ROW, None) or list(range(len(raw_prompts)))
        conversational = self._check_prompts(raw_prompts, split, lambda i: origin.row(numbers[i]))
        keep = [i for i, prompt in enumerate(raw_prompts) if not _is_blank(prompt)]
        if not keep:
            raise UsageError(f"the {split} split has no non-empty prompts")
        if len(keep) < len(raw_prompts):
            dropped = len(raw_prompts) - len(keep)
            _warn(f"dropped {dropped} empty or whitespace-only prompts from the {split} split")
        texts = [self.format_prompt(raw_prompts[i]) for i in keep]
        templated = self.chat_template or conversational
        input_ids, truncated = self._tokenize(texts, split, templated)
        special = self._special_tokens(templated)
        check_representable(
            self.tokenizer, texts, input_ids, split, lambda i: origin.row(numbers[keep[i]]), special
        )
        extras = {name: [values[i] for i in keep] for name, values in columns.items()}
        messages = [list(raw_prompts[i]) for i in keep] if conversational else None
        return PromptRows(input_ids, self._as_seen(texts, input_ids, truncated), extras, messages)

    def _as_seen(self, texts: list[str], input_ids: list[list[int]], truncated: list[int]) -> list[str]:
        """Each prompt's text as the policy sees it: a truncated prompt's kept tokens, decoded. This
        is the text rewards, environments and sample tables get (not the part the policy never saw)."""
        seen = list(texts)
        for index in truncated:
            seen[index] = self.tokenizer.decode(
                input_ids[index], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        return seen

    def _check_prompts(self, prompts: Sequence[Any], split: str, row: Callable[[int], str]) -> bool:
        """Every prompt text, or every prompt a conversation (then the tokenizer needs a chat template);
        returns whether they are conversations. ``row(i)`` names prompt ``i`` for the user."""
        conversational = bool(prompts) and not isinstance(prompts[0], str) and is_conversation(prompts[0])
        for index, prompt in enumerate(prompts):
            if conversational and not is_conversation(prompt):
                raise UsageError(
                    f"{row(index)}: data.prompt_column {self.prompt_column!r} holds conversations (lists "
                    "of {'role': ..., 'content': ...} messages) but this row holds "
                    f"{type(prompt).__name__} ({repr(prompt)[:80]})"
                )
            if not conversational and not isinstance(prompt, str):
                raise UsageError(
                    f"{row(index)}: data.prompt_column {self.prompt_column!r} must hold strings or "
                    f"conversations (lists of {{'role': ..., 'content': ...}} messages), got "
                    f"{type(prompt).__name__} ({repr(prompt)[:80]})"
                )
        if conversational and not getattr(self.tokenizer, "chat_template", None):
            raise UsageError(
                f"tokenizer {self.tokenizer.name_or_path!r} has no chat template, which the {split} split's "
                "conversational prompts (lists of messages) need: use a chat model's tokenizer or set one"
            )
        return conversational

    def format_prompt(self, prompt: str | Sequence[Mapping[str, Any]]) -> str:
        """The text of one raw prompt: a conversation, or (with ``chat_template``) a text prompt as a
        user message, in the tokenizer's chat template with the generation prompt; other text as it is.

        Args:
            prompt: the raw prompt text, or a list of ``{"role", "content"}`` messages.

        Returns:
            The text that is tokenized.
        """
        if isinstance(prompt, str):
            if not self.chat_template:
                return self._preamble() + prompt
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        hermes = self.tools is not None and self.tools.format == "hermes"
        schemas = {"tools": self.tools.schemas()} if hermes else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **schemas
        )

    def _preamble(self) -> str:
        """``data.tool_preamble``: the text-format tools described before a text prompt."""
        if not self.tool_preamble or self.tools is None or self.tools.format != "text":
            return ""
        return self.tools.preamble()

    def _special_tokens(self, templated: bool) -> bool:
        """Whether the tokenizer adds its special tokens: ``add_special_tokens``, or unless templated."""
        if self.add_special_tokens is None:
            # Chat templates already write special tokens such as BOS; adding them again would double them.
            return not templated
        return self.add_special_tokens

    def _tokenize(
        self, texts: list[str], split: str, templated: bool = False
    ) -> tuple[list[list[int]], list[int]]:
        """Tokenize without padding, keeping the last ``max_prompt_length`` tokens of long prompts;
        returns the ids and which prompts were cut."""
        add_special_tokens = self._special_tokens(templated or self.chat_template)
        input_ids: list[list[int]] = []
        for start in range(0, len(texts), _TOKENIZE_CHUNK):
            chunk = texts[start : start + _TOKENIZE_CHUNK]
            input_ids.extend(self.tokenizer(chunk, add_special_tokens=add_special_tokens)["input_ids"])
        truncated = []
        for index, ids in enumerate(input_ids):
            if not ids:
                raise UsageError(f"{split} prompt {texts[index]!r} tokenizes to no tokens")
            if len(ids) > self.max_prompt_length:
                # The end of a prompt (the question, the generation prompt) matters most for the answer.
                input_ids[index] = list(ids[-self.max_prompt_length :])
                truncated.append(index)
        if truncated:
            _warn(
                f"{len(truncated)} of {len(texts)} {split} prompts are longer than data.max_prompt_length "
                f"{self.max_prompt_length} tokens; kept their last {self.max_prompt_length} tokens"
            )
        return input_ids, truncated

    def collate(self, rows: Sequence[Mapping[str, Any]]) -> PromptBatch:
        """Left-pad rows (as yielded by :attr:`train_dataset`) into a :class:`PromptBatch`.

        Args:
            rows: mappings with ``input_ids``, ``prompt`` and optional ``extras``.

        Returns:
            The padded batch.
        """
        return collate_prompts(rows, self.pad_token_id)

    def make_batch(
        self, prompts: Sequence[str | Sequence[Mapping[str, Any]]], extras: dict[str, list] | None = None
    ) -> PromptBatch:
        """Format, tokenize and collate raw prompts directly, e.g. for sampling outside the loaders.

        Args:
            prompts: raw prompt strings, or conversations (lists of ``{"role", "content"}`` messages).
            extras: optional extra columns, one value per prompt.

        Returns:
            The padded batch, truncated like the training data.
        """
        given = RowOrigin("the given prompts")
        conversational = self._check_prompts(prompts, "given", given.row)
        texts = [self.format_prompt(prompt) for prompt in prompts]
        templated = self.chat_template or conversational
        input_ids, truncated = self._tokenize(texts, "given", templated)
        special = self._special_tokens(templated)
        check_representable(self.tokenizer, texts, input_ids, "given", given.row, special)
        messages = [list(prompt) for prompt in prompts] if conversational else None
        rows = PromptRows(input_ids, self._as_seen(texts, input_ids, truncated), dict(extras or {}), messages)
        return self.collate([rows[i] for i in range(len(rows))])

    def _require_setup(self) -> PromptRows:
        if self.train_dataset is None:
            raise RuntimeError("call setup() before asking for dataloaders")
        return self.train_dataset

    def _loader(self, dataset: PromptRows, shuffle: bool, drop_last: bool) -> DataLoader:
        trainer = self.trainer
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        # The sampler's own seeded generator makes the order reproducible without global RNG state.
        sampler = ResumableSampler(
            dataset, self.batch_size, world_size, rank, shuffle=shuffle, seed=self.seed, drop_last=drop_last
        )
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            # Its own generator: creating an iterator draws a worker seed, which must not advance the
            # global RNG that sampling uses (a resumed run creates its iterator at another moment).
            generator=torch.Generator().manual_seed(self.seed),
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            # A partial of a module-level function pickles into workers without the datamodule.
            collate_fn=functools.partial(collate_prompts, pad_token_id=self.pad_token_id),
        )

    def train_dataloader(self) -> DataLoader:
        """Training prompts, shuffled by ``seed`` and epoch, resuming mid-epoch where a run stopped."""
        loader = self._loader(self._require_setup(), self.shuffle, self.drop_last)
        trainer = self.trainer
        if trainer is not None:
            # Read when the epoch's first batch is drawn (the sampler is iterated lazily), after the
            # loop has restored its progress: a checkpoint mid-epoch resumes after the batches it
            # trained on, and one written at the last batch of an epoch (full or cut short by
            # limit_train_batches) starts the next epoch at its beginning. With num_workers > 0 the
            # DataLoader draws indices eagerly, before the loop restores; see docs/resuming.md.
            progress = trainer.fit_loop.epoch_loop.batch_progress
            loader.sampler.batches_done = lambda: progress.current.processed
            if self.num_workers == 0:  # exact: Lightning's "unreliable results" warning is false here
                exact_mid_epoch_resume()
        return loader

    def val_dataloader(self) -> DataLoader | list:
        """Validation prompts in order, or ``[]`` when there is no validation set."""
        self._require_setup()
        if self.val_dataset is None:
            return []
        return self._loader(self.val_dataset, shuffle=False, drop_last=False)
