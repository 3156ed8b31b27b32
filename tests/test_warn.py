"""Every piece of advice the package gives about a run prints as its errors do: one line,
``lightning-ppo: warning: ...``, without the source file's path and line number (issue 42)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

import lightning_ppo
from lightning_ppo.models.loading import load_tokenizer
from lightning_ppo.runs.warn import LightningPPOWarning


def test_a_tokenizer_without_a_pad_token_is_told_in_one_line(tmp_path):
    vocab = {"<eos>": 0, "a": 1, "b": 2}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")))
    tokenizer.eos_token = "<eos>"
    tokenizer.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == 0
    (warning,) = [w for w in caught if "pad token" in str(w.message)]
    assert warning.category is LightningPPOWarning
    shown = warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno)
    said = f"tokenizer {str(tmp_path)!r} has no pad token: using its EOS token '<eos>'"
    assert shown == f"lightning-ppo: warning: {said}\n"


def test_no_module_warns_through_lightning_with_its_source_path():
    """Lightning's rank_zero_warn prints ``/path/file.py:LINE: UserWarning: ...``; the package's advice
    goes through lightning_ppo.runs.warn.warn (rank 0, one line) instead."""
    package = Path(lightning_ppo.__file__).parent
    direct = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "warn.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\brank_zero_warn\(", line)
    ]
    assert direct == []
