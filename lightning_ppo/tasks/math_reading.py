r"""How :mod:`lightning_ppo.tasks.math_answer` reads a final answer and a ground truth, and compares them.

A completion's final answer, the first rule that finds one (docs/gsm8k.md, "How an answer is read"):

1. its last ``\boxed{...}`` (or ``\fbox{...}``) that holds something: the whole box, read as LaTeX;
2. else its last ``<answer>...</answer>``, read as a ground truth is (below);
3. else its free text: after the last "answer is", "answer:" or ``####``, the first number or math
   (``$...$``, ``\(...\)``, ``\[...\]``, a bare ``\frac{a}{b}``); with no such anchor, the last one.

A ground truth (the text after GSM8K's last ``####``, else the whole column) is read by rule 1 when
it has a box, else as a whole, as LaTeX, unless it holds words (``5 dollars``): then by rule 3.

A number is digits with an optional sign (``-`` or Unicode's minus), decimals, a fraction ``a/b``
and an exponent (``1e3``); a comma groups thousands only between groups of three digits (``1,000``;
``(1, 2)`` is a pair), a space never does (``5 100`` is two numbers), ``$`` before and ``%`` after
are dropped. Everything else is Hugging Face's ``math-verify`` (LaTeX to sympy, and the comparison).
An answer ``a = b`` (or ``\approx``) is right when every side without a variable equals the truth,
unless the truth is itself an equation: ``73 = 72`` is not 72, ``x = 72`` and ``48 + 24 = 72`` are.

This file imports nothing of the package: :mod:`lightning_ppo.tasks.math_checkers` runs it as the
script of its worker processes (:func:`serve`), which then need not load torch.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import signal
import sys
from collections.abc import Callable
from fractions import Fraction
from typing import Any, TextIO, TypeVar

MAX_ANSWER_CHARS = 1000  # a longer box, tag or math span is no answer: it is not even parsed

_T = TypeVar("_T")
_MINUS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
_NUMBER = rf"-?(?:{_NUM})(?:/(?:{_NUM}))?(?:[eE][-+]?\d{{1,3}})?(?!\d)"
_PLAIN = re.compile(rf"(-?)(?:\\?\$)?\s*({_NUMBER})\s*(?:\\?%)?")  # a whole piece that is a number
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TAG = re.compile(rf"<answer>(.{{0,{MAX_ANSWER_CHARS}}}?)</answer>", re.S | re.I)
_ANCHOR = re.compile(r"(?i)\banswer[*_\s]*(?:is\b|[:=])|####")
_CLAUSE_END = re.compile(r"\n|[.!?;](?=\s|$)")
_M = MAX_ANSWER_CHARS
_CANDIDATE = re.compile(
    rf"\$\$(?P<display>.{{1,{_M}}}?)\$\$"
    rf"|\\\[(?P<bracket>.{{1,{_M}}}?)\\\]"
    rf"|\\\((?P<paren>.{{1,{_M}}}?)\\\)"
    # pandoc's rule, so that "$5 and $3" is money: no blank inside either $, no digit after the second
    rf"|(?<![\\$\w])\$(?=\S)(?P<inline>(?:\\\$|[^$\n]){{1,{_M}}}?)(?<=\S)\$(?!\d)"
    r"|(?P<frac>-?\\[dt]?frac\{[^{}]{1,100}\}\{[^{}]{1,100}\})"
    rf"|(?<![\w.])(?P<number>{_NUMBER})",
    re.S,
)
_TEXT_COMMANDS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|operatorname)\s*\{[^{}]*\}")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_NO_ANSWER = re.compile(r"(?i)\s*n/?a\s*")  # how datasets mark a row without an answer
_RELATION = re.compile(r"\\approx|\\simeq|\\equiv|\\doteq|≈|(?<![<>!:=\\])=(?![=>])")
_OPENING, _CLOSING = "{([", "})]"


def gsm8k_answer(value: Any) -> str:
    """The answer in a ground-truth value: the text after the last ``####`` (GSM8K's solutions end
    with ``#### 72``), else the whole value; surrounding blanks removed, nothing else."""
    text = str(value)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return text.strip()


def _closings(text: str) -> dict[int, int]:
    """Where each ``{`` of ``text`` closes, in one pass (``\\{`` and ``\\}`` are the math's own)."""
    opened, closings, at = [], {}, 0
    while at < len(text):
        char = text[at]
        if char == "\\":
            at += 2
            continue
        if char == "{":
            opened.append(at)
        elif char == "}" and opened:
            closings[opened.pop()] = at
        at += 1
    return closings


def _last_box(text: str) -> str | None:
    """The contents of the last closed box that holds something; a box longer than
    ``MAX_ANSWER_CHARS`` (or never closed: a reply cut short) is none."""
    starts = [match.end() for match in _BOX.finditer(text)]
    closings = _closings(text) if starts else {}
    for start in reversed(starts):
        end = closings.get(start - 1)
        if end is not None and end - start <= MAX_ANSWER_CHARS and text[start:end].strip():
            return text[start:end]
    return None


def _candidate(match: re.Match[str]) -> str:
    return next(group for group in match.groups() if group is not None)


def _anchored(text: str, start: int) -> str | None:
    """After an anchor, in its clause (to the line's or sentence's end): the first number or math after
    the clause's last ``=`` (``Answer: 48 + 24 = 72``), else its first (``the answer is 18 (3 x 6)``);
    with none in the clause, the first after it (``The answer is:`` and the math on the next line)."""
    end = _CLAUSE_END.search(text, start)
    pick, gap = None, start
    for match in _CANDIDATE.finditer(text, start, end.start() if end else len(text)):
        if pick is None or "=" in text[gap : match.start()]:
            pick = match
        gap = match.end()
    pick = pick or _CANDIDATE.search(text, start)
    return None if pick is None else _candidate(pick)


def _from_text(text: str) -> str | None:
    """Rule 3: the answer after the last anchor, else the last number or math in the text."""
    anchors = list(_ANCHOR.finditer(text))
    answer = _anchored(text, anchors[-1].end()) if anchors else None
    if answer is None:
        matches = list(_CANDIDATE.finditer(text))
        answer = _candidate(matches[-1]) if matches else None
    return answer


def _wordy(text: str) -> bool:
    """Whether ``text`` has words outside LaTeX's commands and ``\\text{}``: prose, not math."""
    return bool(_WORD.search(_TEXT_COMMANDS.sub("", text)))


def _short(text: str) -> str | None:
    """A ground truth or an answer tag: the whole of it as LaTeX, unless it holds words."""
    text = text.strip()
    if not text or len(text) > MAX_ANSWER_CHARS or _NO_ANSWER.fullmatch(text):
        return None
    return _from_text(text) if _wordy(text) or "\n" in text else text


def final_answer(text: str) -> str | None:
    """A completion's final answer as written (``72``, ``2\\sqrt{3}``), ``None`` for none."""
    text = text.translate(_MINUS)
    box = _last_box(text)
    if box is not None:
        return box
    tags = list(_TAG.finditer(text))
    if tags:
        return _short(tags[-1].group(1))
    return _from_text(text)


def truth_answer(value: Any) -> str | None:
    """A ground-truth value's answer as written (``#### 1,000``: ``1,000``), ``None`` for none."""
    text = gsm8k_answer(value).translate(_MINUS)
    box = _last_box(text)
    return box if box is not None else _short(text)


def _clean(piece: str) -> str:
    """A piece without the blanks and sentence punctuation around it, ``1{,}000`` as ``1,000``,
    and no ``$`` (delimiters or money: the piece is read as math either way)."""
    piece = piece.translate(_MINUS).replace("{,}", ",")
    piece = re.sub(r"(?<!\\)\$", "", piece)
    return re.sub(r"(?:\s|\\[,;:! ]|~|[.,;:])+$", "", piece).strip()


def _number(text: str) -> Any:
    """A plain number's value (``1,000``, ``-3/4``, ``1e3``) as a sympy Rational, ``None`` if none."""
    import sympy

    match = _PLAIN.fullmatch(text)
    if match is None:
        return None
    body = match.group(2).replace(",", "").lower()
    mantissa, _, exponent = body.partition("e")
    numerator, _, denominator = mantissa.partition("/")
    try:
        value = Fraction(numerator) / Fraction(denominator or 1) * Fraction(10) ** int(exponent or 0)
    except (ValueError, ZeroDivisionError):  # 1/0, or more digits than Python converts
        return None
    return sympy.Rational(value.numerator, value.denominator) * (-1 if match.group(1) else 1)


def _math_verify() -> Any:
    """``math_verify``, imported on first use (sympy and its grammar take a second to load)."""
    import math_verify

    return math_verify


@functools.lru_cache(maxsize=65536)
def read(piece: str, timeout: int | None = None) -> tuple[Any, ...]:
    """A piece's value as a tuple of one sympy object, ``()`` if it reads as nothing; cached: every
    epoch, and every completion of a group, asks again. ``timeout``: math-verify's, in seconds."""
    piece = _clean(piece)
    if not piece or len(piece) > MAX_ANSWER_CHARS:
        return ()
    number = _number(piece)
    if number is not None:
        return (number,)
    mv = _math_verify()
    latex = "$" + piece.replace("\n", " ") + "$"
    config = [mv.LatexExtractionConfig(boxed_match_priority=-1)]
    parsed = mv.parse(latex, config, "no_fallback", "first_match", parsing_timeout=timeout)
    return tuple(value for value in parsed if not isinstance(value, str))[:1]


def sides(piece: str) -> list[str]:
    """The sides of an equation ``a = b \\approx c`` outside any brackets; ``[piece]`` when it is none,
    or a list of several (``x = 1, y = 2``), which math-verify compares as a whole."""
    depth, cuts, commas = 0, [], False
    relations = {m.start(): m.end() for m in _RELATION.finditer(piece)}
    at = 0
    while at < len(piece):
        char = piece[at]
        if char == "\\" and at not in relations:
            at += 1  # a command's name, or \\{ and \\}: a set's brackets, counted next
            continue
        depth += (char in _OPENING) - (char in _CLOSING)
        if depth == 0 and at in relations:
            cuts.append((at, relations[at]))
            at = relations[at]
            continue
        commas |= depth == 0 and char in ",;"
        at += 1
    if not cuts or commas:
        return [piece]
    bounds = [0] + [i for cut in cuts for i in cut] + [len(piece)]
    return [piece[bounds[i] : bounds[i + 1]] for i in range(0, len(bounds), 2)]


def _closed(values: tuple[Any, ...]) -> bool:
    """Whether a read value is a number or a closed expression (no variable: not ``x`` of ``x = 72``)."""
    return bool(values) and not getattr(values[0], "free_symbols", None)


def is_correct(completion: str, truth: Any, timeout: int | None = None) -> bool:
    """Whether ``completion``'s final answer equals the ground truth ``truth`` (a column's value);
    ``timeout``: math-verify's own, per parse and comparison (``None`` off the main thread)."""
    expected, answer = truth_answer(truth), final_answer(completion)
    value = read(expected, timeout) if expected is not None else ()
    if not value or answer is None:
        return False
    verify = functools.partial(_math_verify().verify, list(value), timeout_seconds=timeout)
    parts = sides(_clean(answer))
    if len(parts) == 1 or len(sides(_clean(expected))) > 1:  # no equation, or one asked for
        return bool(verify(list(read(answer, timeout))))
    closed = [values for values in (read(part, timeout) for part in parts) if _closed(values)]
    return bool(closed) and all(verify(list(values)) for values in closed)


class _Late(BaseException):
    """Raised by the worker's alarm: a BaseException, so that no ``except Exception`` of sympy's or
    math-verify's swallows it."""


def within(seconds: float, call: Callable[[], _T]) -> _T | None:
    """``call()``, or ``None`` once it has run ``seconds`` (by SIGALRM: a main thread, on POSIX)."""

    def late(signum: int, frame: Any) -> None:
        raise _Late

    if not hasattr(signal, "setitimer"):  # Windows: the batch's deadline alone bounds it
        return call()
    previous = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return call()
    except _Late:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def serve() -> None:
    """A checker process: reads ``{"truth", "completion", "seconds"}`` lines, answers each with
    ``{"correct": true | false | null}`` (``null``: not done within its seconds) after ``{"ready": true}``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it ends this process
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its timeout and parse warnings
    answers, sys.stdout = sys.stdout, sys.stderr  # a stray print must not come between two answers
    is_correct("1", "1")  # sympy's and math-verify's first use, before the first batch
    _answer(answers, {"ready": True})
    while line := sys.stdin.readline():  # until the trainer closes the pipe (or is gone)
        request = json.loads(line)
        check = functools.partial(is_correct, request["completion"], request["truth"])
        _answer(answers, {"correct": within(request["seconds"], check)})


def _answer(answers: TextIO, message: dict[str, bool | None]) -> None:
    """One line of the worker's protocol to the trainer, sent at once."""
    answers.write(json.dumps(message) + "\n")
    answers.flush()


if __name__ == "__main__":
    serve()
