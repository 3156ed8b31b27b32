"""Prompts with characters the tokenizer cannot represent.

A tokenizer writes its unknown token for text outside its vocabulary, silently: the char-level
tokenizers of ``tasks/tiny.py`` write their EOS token for "x" in a digits-only vocabulary or for "é"
in the default one. Such a prompt is refused with an error naming its row rather than counted
and replaced, because the replacement changes the task: the policy reads another prompt (here
one holding an end-of-sequence mark) than the text the reward function is given, so it is
trained toward answers to a question it never saw. The fix (clean the data, widen the alphabet,
pick another tokenizer) is the user's to choose. Byte-level tokenizers (GPT-2, Llama 3) represent
every string and never trigger this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from lightning_ppo.runs.errors import UsageError


def unknown_token(tokenizer: PreTrainedTokenizerBase) -> tuple[str, int] | None:
    """The token (text, id) a tokenizer writes for text outside its vocabulary; None if it has none.

    Tokenizers built on a ``tokenizers`` model may declare it only there, as the tiny ones do.
    """
    if tokenizer.unk_token_id is not None:
        return tokenizer.unk_token, tokenizer.unk_token_id
    backend = getattr(tokenizer, "backend_tokenizer", None)
    token = getattr(getattr(backend, "model", None), "unk_token", None)
    if token is None:
        return None
    return token, tokenizer.convert_tokens_to_ids(token)


def _unknown_chars(tokenizer: PreTrainedTokenizerBase, text: str, token_id: int) -> list[str]:
    """The pieces of ``text`` read as the unknown token (fast tokenizers only: they give offsets)."""
    if not tokenizer.is_fast:
        return []
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    pieces = (
        text[start:end]
        for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
        if token == token_id and text[start:end] != tokenizer.convert_ids_to_tokens(token_id)
    )
    return list(dict.fromkeys(pieces))


def check_representable(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    input_ids: Sequence[list[int]],
    split: str,
    row: Callable[[int], str],
    add_special_tokens: bool,
) -> None:
    """Fail, naming the first row, when a prompt tokenizes to more unknown tokens than it spells out.

    Args:
        tokenizer: the tokenizer that produced ``input_ids``.
        texts: the prompts as tokenized.
        input_ids: their token ids.
        split: split name for the message.
        row: names text ``i`` for the user: its file and line, or its 1-based row (blank prompts are
            already left out of ``texts``).
        add_special_tokens: whether ``input_ids`` include the tokenizer's own special tokens, which
            may be the unknown token itself (the tiny tokenizers' unknown token is EOS).
    """
    unknown = unknown_token(tokenizer)
    if unknown is None:
        return
    token, token_id = unknown
    added = tokenizer("", add_special_tokens=add_special_tokens)["input_ids"].count(token_id)
    bad = [
        i
        for i, (text, ids) in enumerate(zip(texts, input_ids, strict=True))
        if ids.count(token_id) > text.count(token) + added
    ]
    if not bad:
        return
    text = texts[bad[0]]
    chars = _unknown_chars(tokenizer, text, token_id)
    shown = f" ({', '.join(map(repr, chars))})" if chars else ""
    raise UsageError(
        f"{row(bad[0])}: prompt {text[:80]!r} has characters the tokenizer cannot "
        f"represent{shown}, read as its unknown token {token!r} ({len(bad)} of {len(texts)} {split} "
        "prompts have some): remove them or use a tokenizer that covers them"
    )
