"""What the three benchmark variants share: sizes, checkpoints built from configs, timing, memory, FLOPs.

Each variant (``run_lightning``, ``run_trl``, ``floor``) runs in its own subprocess as
``python -m benchmarks.<variant> SPEC.json RESULT.json``: it reads a :class:`RunSpec`, runs
``spec.iterations`` PPO iterations and writes a result dict (per-iteration seconds, per-phase
seconds, peak RSS). ``benchmarks/bench.py`` drives them and prints the tables.

Every variant does the same PPO work per iteration: sample ``response_length`` tokens for
``batch_size`` prompts with HF ``generate`` (KV cache); policy, reference, value and reward
forwards over prompt + response; per-token KL penalty, GAE, whitened advantages; then
``ppo_epochs`` x ``num_minibatches`` of policy + value forward, backward and one AdamW step.
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Offline, quiet, and no telemetry in any variant.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# PPO hyper-parameters shared by every variant (the setting; TRL's defaults where it has one).
KL_COEF = 0.05
VF_COEF = 0.1
CLIP_RANGE = 0.2
VALUE_CLIP_RANGE = 0.2
GAMMA = 1.0
GAE_LAMBDA = 0.95
TEMPERATURE = 1.0
LEARNING_RATE = 1e-5
NUM_DIGITS = 5  # prompts are "47192=": 6 tokens of the char tokenizer


@dataclass(frozen=True)
class ModelPreset:
    """A model size. Policy, reference, value and reward models all have this shape.

    ``extra_vocab`` characters are added to the char tokenizer's alphabet so that a large model
    gets a realistically sized LM head (the prompts still use digits only).
    """

    name: str
    arch: str  # "gpt2", "llama" or "qwen2"
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int = 512
    extra_vocab: int = 0
    # Llama / Qwen2 only: grouped-query attention's key/value heads (0: one per head) and the MLP
    # width (0: 4 x n_embd)
    n_kv_head: int = 0
    intermediate: int = 0


PRESETS = {
    "tiny": ModelPreset("tiny", "gpt2", 1, 32, 2),
    # The GPU model's architecture and vocabulary at a CPU-friendly size (exercises that code path).
    "tiny-llama": ModelPreset("tiny-llama", "llama", 1, 32, 2, extra_vocab=32000),
    "small": ModelPreset("small", "gpt2", 2, 128, 4),
    "medium": ModelPreset("medium", "gpt2", 4, 256, 4),
    # ~0.47B parameters with a 32k vocabulary: a Llama-style model for the GPU run.
    "llama-0.5b": ModelPreset("llama-0.5b", "llama", 24, 1024, 16, n_positions=2048, extra_vocab=32000),
    # Qwen2.5-0.5B-Instruct's shape (configs/gsm8k_*.yaml's model), random weights: 24 x 896, 14 heads
    # over 2 key/value heads, MLP 4864, its 151936-token vocabulary, tied embeddings (~0.49B)
    "qwen2.5-0.5b": ModelPreset(
        "qwen2.5-0.5b", "qwen2", 24, 896, 14, 4096, 151936 - 50, n_kv_head=2, intermediate=4864
    ),  # 151936 - 50: the char tokenizer's 48 characters, PAD and BOS come first
}


@dataclass
class RunSpec:
    """One benchmark run of one variant (JSON-serialisable; it crosses a process boundary)."""

    variant: str  # "lightning_ppo", "trl", "floor", "lightning_ppo_shared" or "lightning_ppo_vllm"
    preset: str
    policy: str  # checkpoint folders written by build_checkpoints
    reward: str
    device: str = "cpu"
    precision: str = "32"  # "32" or "bf16-mixed"
    batch_size: int = 64
    num_minibatches: int = 4
    ppo_epochs: int = 4
    response_length: int = 32
    iterations: int = 8
    seed: int = 0
    phases: bool = True  # per-phase timers (synchronising on CUDA) in lightning_ppo and the floor
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default (one per physical core)
    engine: str = "hf"  # lightning_ppo's generation.engine: "hf" or "vllm" (lightning_ppo_vllm)
    # "fixed": every prompt NUM_DIGITS + 1 tokens, every response response_length tokens.
    # "variable": prompts of 8 to 2 x response_length tokens, responses cut at 1 to response_length
    # tokens by length_schedule (see variable_prompts).
    workload: str = "fixed"
    prompt_length: int = 0  # "fixed": tokens per prompt; 0 keeps the quickstart's NUM_DIGITS + 1
    micro_batch_tokens: int | None = None  # lightning_ppo's ppo.micro_batch_tokens
    cache: str = "static"  # lightning_ppo's generation.cache_implementation
    # count aten ops and host reads per iteration (benchmarks.op_count) instead of timing: the
    # dispatch mode slows every op down, so a counting run's seconds are not reported
    count_ops: bool = False


@dataclass
class RunResult:
    """What a variant reports back to the driver."""

    spec: dict[str, Any]
    iteration_s: list[float] = field(default_factory=list)  # wall seconds of each PPO iteration
    gc_s: list[float] = field(default_factory=list)  # seconds of garbage collection in each iteration
    phases: list[dict[str, float]] = field(default_factory=list)  # per iteration: phase -> seconds
    peak_rss_mib: float = 0.0
    # the peak until the last iteration ended: without what the run does after training (Lightning's
    # teardown moves the module and its optimizer state to the CPU); the whole run's for the others
    train_rss_mib: float | None = None
    peak_gpu_mib: float | None = None
    response_width: int | None = None  # generated tokens per sequence (the last iteration's)
    device_name: str = ""
    error: str | None = None
    # policy forward tokens of all iterations (rollout forward and every PPO pass): rows x columns
    # computed, and the real (attended) ones among them
    tokens_computed: int = 0
    tokens_real: int = 0
    # with RunSpec.count_ops, per iteration: aten ops dispatched, host reads, and the ops by name
    ops: list[int] = field(default_factory=list)
    host_reads: list[int] = field(default_factory=list)
    ops_by_name: list[dict[str, int]] = field(default_factory=list)

    def median_s(self) -> float:
        """Median seconds per iteration, the first iteration (warm-up) excluded."""
        steady = self.iteration_s[1:] or self.iteration_s
        return statistics.median(steady) if steady else float("nan")


# ----------------------------------------------------------------------------- checkpoints
def build_tokenizer(preset: ModelPreset):
    """lightning_ppo's char tokenizer (digits, letters, punctuation; CJK characters as extra
    vocabulary), except that EOS has the last id, one past the models' output vocabulary.

    The models can then never sample EOS, so no response stops early: every variant generates and
    trains on exactly ``response_length`` tokens per sequence, whatever the random policy does
    (with EOS 1 of 51 tokens, a 256-token generation would otherwise end after ~180 tokens).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lightning_ppo.tasks.tiny import BOS, DEFAULT_ALPHABET, EOS, PAD

    # CJK ideographs onwards: single code points, none of them a surrogate for 32k characters.
    alphabet = DEFAULT_ALPHABET + "".join(extra_characters(preset.extra_vocab))
    tokens = [PAD, BOS, *dict.fromkeys(alphabet), EOS]
    tokenizer = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token=PAD))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS, bos_token=BOS)


def extra_characters(count: int) -> Iterator[str]:
    """``count`` single code points from the CJK ideographs on, past the surrogates (which cannot be
    saved as UTF-8) and the plane's last two non-characters: enough for a 152k vocabulary."""
    code = 0x4E00
    while count:
        if not (0xD800 <= code <= 0xDFFF or code & 0xFFFE == 0xFFFE):
            yield chr(code)
            count -= 1
        code += 1


def model_config(preset: ModelPreset, tokenizer: Any, **extra: Any):
    """A GPT-2 or Llama config of ``preset``'s size whose output vocabulary stops short of EOS."""
    from transformers import GPT2Config, LlamaConfig

    shared = dict(vocab_size=len(tokenizer) - 1, bos_token_id=tokenizer.bos_token_id, eos_token_id=None)
    shared.update(pad_token_id=tokenizer.pad_token_id, **extra)
    if preset.arch == "gpt2":
        return GPT2Config(
            n_layer=preset.n_layer,
            n_embd=preset.n_embd,
            n_head=preset.n_head,
            n_positions=preset.n_positions,
            **shared,
        )
    llama_like = dict(
        num_hidden_layers=preset.n_layer,
        hidden_size=preset.n_embd,
        intermediate_size=preset.intermediate or 4 * preset.n_embd,
        num_attention_heads=preset.n_head,
        num_key_value_heads=preset.n_kv_head or preset.n_head,
        max_position_embeddings=preset.n_positions,
        **shared,
    )
    if preset.arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(tie_word_embeddings=True, rope_theta=1e6, **llama_like)
    return LlamaConfig(**llama_like)


def build_checkpoints(preset: ModelPreset, out_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write a random policy (causal LM) and a random reward model (one-output sequence classifier)
    of ``preset``'s shape, with the tokenizer, by ``save_pretrained``. Returns the two folders."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    tokenizer = build_tokenizer(preset)
    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_config(model_config(preset, tokenizer))
    torch.manual_seed(seed + 1)
    reward = AutoModelForSequenceClassification.from_config(model_config(preset, tokenizer, num_labels=1))
    folders = out_dir / "policy", out_dir / "reward"
    for model, folder in zip((policy, reward), folders, strict=True):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folders


def prompts(num: int, seed: int = 0, length: int = 0) -> list[str]:
    """The quickstart's digit prompts (``"47192="``), the same in every variant; ``length``: prompts of
    that many tokens instead (``length - 1`` digits and ``=``), e.g. 200 for the GSM8K recipe's."""
    from lightning_ppo.tasks.digits import digit_prompts

    return digit_prompts(num, prompt_digits(length), seed)["prompt"]


def prompt_digits(length: int) -> int:
    """The digits of a fixed-workload prompt of ``length`` tokens (0: the quickstart's)."""
    return length - 1 if length else NUM_DIGITS


# ----------------------------------------------------------------------------- the variable-length workload
def variable_prompts(num: int, max_response: int, seed: int = 0) -> list[str]:
    """Digit prompts of 8 to ``2 x max_response`` tokens, uniform (one token per character)."""
    rng = random.Random(seed)
    lengths = [rng.randint(7, 2 * max_response - 1) for _ in range(num)]
    return ["".join(rng.choice("0123456789") for _ in range(n)) + "=" for n in lengths]


def scheduled_length(prompt: str, max_response: int) -> int:
    """The response length every variant gives ``prompt``: 1 to ``max_response``, from its text."""
    return 1 + zlib.crc32(prompt.encode()) % max_response


def length_schedule(responses: Any, prompts: list[str], max_response: int, pad: int):
    """(responses, mask): the sampled responses cut at their prompts' scheduled lengths, so that
    every variant computes on the same lengths (the benchmark's models never sample EOS, so
    generation runs to ``max_response`` everywhere; the cut marks the rest as padding)."""
    import torch

    width = responses.shape[1]
    lengths = torch.tensor([scheduled_length(p, max_response) for p in prompts], device=responses.device)
    mask = torch.arange(width, device=responses.device)[None, :] < lengths.clamp(max=width)[:, None]
    return responses.masked_fill(~mask, pad), mask


# ----------------------------------------------------------------------------- timing and memory
def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class PhaseTimer:
    """Wall seconds per named phase of each iteration. On CUDA it synchronises around every phase,
    so it is only enabled when asked (``RunSpec.phases``); disabled, it costs nothing."""

    def __init__(self, device: str, enabled: bool = True) -> None:
        self.device, self.enabled = device, enabled
        self.current: dict[str, float] = defaultdict(float)
        self.history: list[dict[str, float]] = []

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.current[name] += time.perf_counter() - start

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn`` with its calls timed as phase ``name``."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self(name):
                return fn(*args, **kwargs)

        return timed

    def end_iteration(self) -> None:
        if self.enabled:
            self.history.append(dict(self.current))
        self.current.clear()


class IterationClock:
    """Marks the end of each iteration; ``intervals()`` are the wall seconds between marks, and
    ``gc_intervals()`` the seconds Python's garbage collector ran in each (explicit or automatic)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.marks: list[float] = []
        self.gc_marks: list[float] = []
        self._gc_total = 0.0
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_total += time.perf_counter() - self._gc_start

    def mark(self) -> None:
        synchronize(self.device)
        self.marks.append(time.perf_counter())
        self.gc_marks.append(self._gc_total)
        if COUNTER is not None:
            COUNTER.mark()

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]

    def gc_intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.gc_marks, self.gc_marks[1:], strict=False)]


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far: Linux's VmHWM, the peak of this program's own
    memory. Not ``ru_maxrss``, which a process started by fork and exec inherits from its parent:
    every run read at least the benchmark driver's RSS at the fork (4.3 GB after it wrote the
    llama-0.5b checkpoints), whatever it used itself. Elsewhere ``ru_maxrss`` (macOS: bytes)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    n = torch.get_num_threads()
    return f"CPU, {n} thread{'' if n == 1 else 's'}"


def finish(result: RunResult, device: str) -> RunResult:
    """Fill in the memory figures and the device name."""
    import torch

    result.peak_rss_mib = peak_rss_mib()
    result.train_rss_mib = result.train_rss_mib or result.peak_rss_mib
    result.device_name = device_name(device)
    if device.startswith("cuda"):
        result.peak_gpu_mib = torch.cuda.max_memory_allocated() / 2**20
    return result


# The op counter of a counting run (RunSpec.count_ops): every IterationClock.mark() marks it too.
COUNTER: Any = None


def counted_run(run: Callable[[RunSpec], RunResult], spec: RunSpec) -> RunResult:
    """``run(spec)`` under an op counter, its aten ops and host reads per iteration (between the
    iteration clock's marks) in the result."""
    global COUNTER
    from benchmarks.op_count import OpCounter

    with OpCounter() as COUNTER:
        result = run(spec)
    counter, COUNTER = COUNTER, None
    result.ops, result.host_reads = (list(c) for c in zip(*counter.per_interval(), strict=True))
    result.ops_by_name = counter.by_name_per_interval()
    return result


def runner_main(run: Callable[[RunSpec], RunResult]) -> None:
    """Entry point of a variant's subprocess: ``python -m benchmarks.<variant> SPEC.json RESULT.json``."""
    spec_path, result_path = sys.argv[1], sys.argv[2]
    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    if spec.threads:
        import torch

        torch.set_num_threads(spec.threads)
    result = counted_run(run, spec) if spec.count_ops else run(spec)
    Path(result_path).write_text(json.dumps(asdict(result)))


# ----------------------------------------------------------------------------- FLOPs
@dataclass
class ModelShape:
    """What the FLOPs estimate needs to know about a model."""

    n_layer: int
    d_model: int
    vocab: int
    params: int  # non-embedding parameters (no token/position embeddings, no LM head)


def model_shape(checkpoint: str | Path) -> ModelShape:
    """The shape of a causal-LM checkpoint, from its config (built on the meta device: no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    positions = sum(p.numel() for name, p in model.named_parameters() if name.endswith("wpe.weight"))
    params = total - embed.numel() - positions - (0 if head is embed else head.numel())
    return ModelShape(config.num_hidden_layers, config.hidden_size, config.vocab_size, params)


def forward_flops(shape: ModelShape, seq_len: int, head_positions: int) -> float:
    """Model FLOPs of one forward over ``seq_len`` tokens, the LM head on ``head_positions`` of them.

    2 x params per token for the matmuls, plus 4 x n_layer x seq_len x d for attention scores and
    their weighted sum (PaLM's convention, no causal discount), plus 2 x d x vocab per LM-head position.
    """
    per_token = 2 * shape.params + 4 * shape.n_layer * seq_len * shape.d_model
    return seq_len * per_token + head_positions * 2 * shape.d_model * shape.vocab


def iteration_flops(
    shape: ModelShape,
    batch: int,
    prompt_len: int,
    response_len: int,
    ppo_epochs: int,
    separate_critic: bool = True,
) -> dict[str, float]:
    """Model FLOPs of one PPO iteration by part: ``generation``, ``rollout`` forwards and ``train``.

    Value and reward models are the policy's shape without the LM head; the backward pass costs
    twice the forward. A shared critic is a head on the policy's forward (its FLOPs are negligible).
    """
    length = prompt_len + response_len
    policy = forward_flops(shape, length, response_len)
    critic = forward_flops(shape, length, 0) if separate_critic else 0.0
    reward = forward_flops(shape, length, 0)
    # Generation: a prefill, then one token at a time against a KV cache of growing length.
    generation = forward_flops(shape, prompt_len, 1)
    for t in range(1, response_len):
        context = prompt_len + t
        generation += 2 * shape.params + 4 * shape.n_layer * context * shape.d_model
        generation += 2 * shape.d_model * shape.vocab
    rollout = 2 * policy + critic + reward  # policy, reference, value, reward
    train = ppo_epochs * 3 * (policy + critic)
    return {"generation": batch * generation, "rollout": batch * rollout, "train": batch * train}


# Dense peak TFLOP/s by device-name substring, (bf16, fp32 without TF32); first match wins.
PEAK_TFLOPS = (
    ("H200", (989.0, 67.0)),
    ("H100 PCIe", (756.0, 51.0)),
    ("H100", (989.0, 67.0)),
    ("A100", (312.0, 19.5)),
    ("L40S", (362.0, 91.6)),
    ("A10G", (125.0, 31.2)),
    ("L4", (121.0, 30.3)),
)


def peak_tflops(name: str, precision: str) -> float | None:
    """The device's dense peak for the precision's matmuls, or None when unknown (e.g. a CPU)."""
    for key, (bf16, fp32) in PEAK_TFLOPS:
        if key in name:
            return bf16 if precision.startswith("bf16") else fp32
    return None


def quiet_fit_command(config: str, policy: str, out: Path, iterations: int) -> list[str]:
    """``lightning-ppo fit`` of ``configs/<config>`` for ``iterations`` iterations under ``out``: a CSV
    log only, no callbacks, checkpoints, validation or progress bar (the learning benchmarks' runs)."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "lightning_ppo.cli", "fit", "--config", str(root / "configs" / config)]
    cmd += ["--model.init_args.policy", policy, "--trainer.default_root_dir", str(out)]
    cmd += ["--trainer.limit_train_batches", str(iterations), "--trainer.enable_progress_bar", "false"]
    cmd += ["--trainer.val_check_interval", "null", "--trainer.limit_val_batches", "0"]
    cmd += ["--trainer.logger", '[{"class_path": "lightning_ppo.loggers.CSVLogger"}]']
    cmd += ["--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false"]
    return cmd


def pinned_child(
    module: str, args: list[str], cores: str, env: dict[str, str], root: Path | None = None
) -> dict:
    """``python -m MODULE --child ARGS`` on ``cores`` (taskset), its environment added to ours; the
    JSON of its last line of output. ``root``: the checkout it runs in (its ``lightning_ppo`` and
    ``benchmarks``; another checkout's, such as a ``git worktree`` of an earlier commit), this one's
    by default."""
    command = ["taskset", "-c", cores, sys.executable, "-m", module, "--child", *args]
    root = root or Path(__file__).resolve().parents[1]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, cwd=root)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def timed_digits_fit(module: Any, batches: int, batch_size: int) -> list[float]:
    """Fit ``module`` on the quickstart's digits task for ``batches`` batches on CPU, quietly; the
    seconds of each training step (batch start to batch end)."""
    import lightning.pytorch as pl

    from lightning_ppo.tasks.digits import DigitsDataModule

    seconds: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            seconds.append(time.perf_counter() - self.start)

    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=batches,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    data = DigitsDataModule(num_prompts=batch_size * batches, batch_size=batch_size, max_prompt_length=16)
    trainer.fit(module, data)
    return seconds
