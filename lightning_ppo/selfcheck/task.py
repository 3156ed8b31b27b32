"""The selfcheck's single-turn task: a tiny policy, two prompts, a reward over a few tokens.

The policy is a random 2-layer GPT-2 (32 wide, one head of 32: vLLM's CPU attention has kernels
from 32) over a three-character vocabulary (``x``, ``y``, ``z``) and its stop token, which also
pads; the other special tokens are suppressed, so a response of at most three tokens is one of 40,
all listed (:mod:`lightning_ppo.selfcheck.responses`). Its weights are drawn wider than
GPT-2's default so that the reference is far from uniform and differs from one prefix to the next
(a log-prob read one token off then reads another number, not the same near-uniform one).

The reward ``count(prompt's character) / 3 + offset(prompt)`` gives the prompt ``y`` half a point
more whatever the policy says: the return of a prefix depends on the prompt, so GAE needs a critic
that tells the prompts apart (or GRPO/RLOO a group baseline of the same prompt); the count makes it
depend on every token. At ``beta`` 0.3 the optimum's mean reward sits between the reference's and
the greedy answer's, far from both (``docs/selfcheck.md``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import Tensor
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lightning_ppo.data import PromptDataModule
from lightning_ppo.rewards import RewardFunction, ScoreInputs
from lightning_ppo.runs.file_modes import save_pretrained
from lightning_ppo.tasks.tiny import PAD, build_char_tokenizer

# written last into a built checkpoint folder: another rank that sees it may load the folder
_READY = "selfcheck-task.json"
_BUILD = 2  # raised whenever build() makes another checkpoint from the same fields
HINT_BETA = 0.5  # the optimum halfway between the reference (0.62) and the greedy answer (1.35)
# the dataset columns naming who scores a row (the two-rater task) and its coin (+1 or -1, heads and
# tails in turn over each rater's rows): the policy never sees them
RATER, COIN = "rater", "coin"


def prompt_char_score(prompt: str, completion: str, length: int, offsets: dict[str, float]) -> float:
    """The task's reward: the share of ``length`` positions holding the prompt's character, plus the
    prompt's offset."""
    return completion.count(prompt) / length + offsets.get(prompt, 0.0)


def rater_score(rater: str, completion: str, length: int, raters: dict[str, float]) -> float:
    """What ``rater`` gives a completion on average over its coin: the share of ``length`` positions
    holding its character, times its scale."""
    return raters[rater] * completion.count(rater) / length


class PromptCharReward(RewardFunction):
    """:func:`prompt_char_score` of each completion, as the run's reward; with ``raters``,
    :func:`rater_score` by the rater of each row (the dataset's ``rater`` column, which the policy
    never sees).

    Args:
        length: The response length budget (``generation.max_new_tokens``).
        offsets: A constant added to each prompt's reward.
        raters: Each rater's character and scale; empty: the prompt's character is counted.
        noise: What a rater adds times its row's coin (the ``coin`` column, +1 or -1).
    """

    def __init__(
        self,
        length: int = 3,
        offsets: dict[str, float] | None = None,
        raters: dict[str, float] | None = None,
        noise: dict[str, float] | None = None,
    ) -> None:
        self.length, self.offsets = length, dict(offsets or {})
        self.raters, self.noise = dict(raters or {}), dict(noise or {})

    def __call__(self, prompts: list[str], completions: list[str], batch: ScoreInputs) -> Tensor:
        if self.raters:
            rows = zip(batch.extras[RATER], batch.extras[COIN], completions, strict=True)
            scores = [
                rater_score(rater, c, self.length, self.raters) + self.noise.get(rater, 0.0) * coin
                for rater, coin, c in rows
            ]
        else:
            rows = zip(prompts, completions, strict=True)
            scores = [prompt_char_score(p, c, self.length, self.offsets) for p, c in rows]
        return torch.tensor(scores, dtype=torch.float32)


class SelfcheckPrompts(PromptDataModule):
    """The task's prompts in turn (``x y x y ...``), unshuffled: every batch of an even size holds as
    many of each, on every rank together, so ``objective/scores`` varies only by the responses. With
    raters, each prompt's rows take the raters in turn (a ``rater`` column), and each rater's rows a
    coin, heads and tails in turn (a ``coin`` column, +1 and -1: every batch holds as many of each); on
    2 ranks the sampler deals the rows in turn, so each rank gets one kind of row (one prompt, or one
    rater).

    Args:
        task_prompts: The prompts, cycled.
        iterations: Batches each rank gets (one epoch); the rows are made for every rank's.
        raters: The raters, cycled within each prompt; empty: no ``rater`` column.
        shuffle: Off: shuffled, a batch would hold the prompts in random proportions, and their
            different rewards would add to the noise of its mean.
        **kwargs: Everything ``PromptDataModule`` takes (``batch_size``, ...).
    """

    def __init__(
        self,
        task_prompts: list[str],
        iterations: int,
        raters: list[str] | None = None,
        shuffle: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(shuffle=shuffle, **kwargs)
        self.task_prompts, self.iterations, self.raters = list(task_prompts), iterations, list(raters or [])

    def load_dataset(self) -> datasets.Dataset:
        world = self.trainer.world_size if self.trainer is not None else 1
        rows = range(self.iterations * self.batch_size * world)
        prompts = self.task_prompts
        columns = {"prompt": [prompts[i % len(prompts)] for i in rows]}
        if self.raters:
            kinds = len(prompts) * len(self.raters)
            columns[RATER] = [self.raters[(i // len(prompts)) % len(self.raters)] for i in rows]
            columns[COIN] = [1.0 if (i // kinds) % 2 == 0 else -1.0 for i in rows]
        return datasets.Dataset.from_dict(columns)


@dataclass(frozen=True)
class SelfcheckTask:
    """The task and its tiny policy.

    Attributes:
        alphabet: The characters of the vocabulary (each a token), besides pad, EOS and BOS.
        prompts: The prompts, drawn equally often.
        offsets: Each prompt's constant in the reward.
        max_new_tokens: The longest response (of each turn).
        beta: The KL coefficient ``ppo.kl_coef`` the optimum is computed at.
        turns: 1: the prompt-character task above; 2: the hint task (:mod:`.hint`), its environment
            between the turns (:meth:`two_turns` sets its length and beta).
        raters: Each rater's character and scale (:meth:`two_raters`); empty: the prompt's character is
            counted, plus its offset.
        noise: What each rater adds times its row's coin (+1 or -1, as many of each in every batch): a
            noisy rater, whose noise leaves the optimum and the batch means where they are.
        n_layer, n_embd, n_head: The GPT-2's size.
        init_range: The std its weights are drawn with (GPT-2's default is 0.02).
        seed: The seed its weights are drawn with.
    """

    alphabet: str = "xyz"
    prompts: tuple[str, ...] = ("x", "y")
    offsets: dict[str, float] = field(default_factory=lambda: {"y": 0.5})
    max_new_tokens: int = 3
    beta: float = 0.3
    n_layer: int = 2
    n_embd: int = 32
    n_head: int = 1
    init_range: float = 0.1
    seed: int = 0
    turns: int = 1
    raters: dict[str, float] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)

    @classmethod
    def two_turns(cls, **fields: object) -> SelfcheckTask:
        """The hint task: replies of at most two tokens (13 per turn, 338 episodes per prompt)."""
        return cls(**{"turns": 2, "max_new_tokens": 2, "beta": HINT_BETA, **fields})

    @classmethod
    def two_raters(cls, **fields: object) -> SelfcheckTask:
        """One prompt, ``z``, and two raters the policy cannot tell apart, taking the rows in turn:
        ``x`` pays ``count(x) / 3``, ``y`` pays ``3 count(y) / 3`` plus or minus 1.5 by a coin. The
        optimum tilts the reference by their mean; a setup that weighs one rater's rows more than the
        other's (by the spread of their rewards) lands elsewhere."""
        raters = {"raters": {"x": 1.0, "y": 3.0}, "noise": {"y": 1.5}}
        return cls(**{"prompts": ("z",), "offsets": {}, **raters, **fields})

    @property
    def rows_per_cycle(self) -> int:
        """The kinds of row the data deals in turn (prompt x rater): a batch holds as many of each."""
        return len(self.prompts) * max(len(self.raters), 1)

    @property
    def iterations(self) -> int:
        """How long the selfcheck trains it by default: two turns take longer to settle (their plateau
        0.03-0.05 nats from the optimum after 120 iterations, 0.02-0.04 after 240)."""
        return 120 if self.turns == 1 else 200

    @property
    def budget(self) -> int:
        """The response tokens of an episode at most: both replies and the one-token hint between."""
        return self.max_new_tokens if self.turns == 1 else 2 * self.max_new_tokens + 1

    def key(self) -> str:
        """A short hash of every field and of how :meth:`build` builds: the name of this task's
        checkpoint folder (a folder an older build wrote is never taken for this one's)."""
        fields = {**asdict(self), "build": _BUILD}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]

    def suppressed(self) -> list[str]:
        """The tokens sampling never draws: every special token but the stop token (which pads)."""
        return [PAD, "<bos>"]

    def build(self) -> tuple[GPT2LMHeadModel, PreTrainedTokenizerFast]:
        """The random policy and its tokenizer (in memory)."""
        tokenizer = build_char_tokenizer(self.alphabet)
        # Padding with the stop token, as many Hugging Face models do: a mask read from `ids != pad`
        # instead of from the lengths would then drop every response's stop token.
        tokenizer.pad_token = tokenizer.eos_token
        torch.manual_seed(self.seed)
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_head=self.n_head,
            n_positions=8 + self.budget,
            initializer_range=self.init_range,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        return GPT2LMHeadModel(config).eval(), tokenizer

    def checkpoint(self, root: Path, builds: bool = True, timeout: float = 600.0) -> Path:
        """The policy's folder under ``root``, named by :meth:`key`: built there once (into a temporary
        folder renamed into place, so no rank ever reads half of it), or, with ``builds`` false (a
        rank other than 0), waited for."""
        out = root / f"policy-{self.key()}"
        if builds and not (out / _READY).exists():
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".policy-", dir=root))
            model, tokenizer = self.build()
            save_pretrained(model, staging)
            tokenizer.save_pretrained(staging)
            (staging / _READY).write_text(json.dumps(asdict(self), sort_keys=True))
            try:
                os.rename(staging, out)
            except OSError:  # built meanwhile by another process: theirs is the same
                shutil.rmtree(staging, ignore_errors=True)
        deadline = time.monotonic() + timeout
        while not (out / _READY).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the selfcheck policy {out} was not built within {timeout:.0f} s by rank 0"
                )
            time.sleep(0.5)
        return out


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The prompt's token ids as the data module makes them (the tokenizer's special tokens added)."""
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
