"""Decoding alone: milliseconds per generated token against the response length, for each cache.

    .venv/bin/python -m benchmarks.decoding                      # CPU: tiny-llama, batch 8, fp32
    .venv/bin/python -m benchmarks.decoding --device cuda        # llama-0.5b, batch 64, bf16-mixed (~5 min)
    .venv/bin/python -m benchmarks.decoding --lengths 32 --modes static,compiled --repeats 1

For each new-token length (32, 256, 1024 by default) and each mode, ``lightning_ppo``'s own
``rollout.sampling.generate`` samples that many tokens for every prompt (the benchmark's models
never sample their stop token, so every generation runs to the length): ``static`` and ``dynamic``
are the eager caches (``generation.cache_implementation``), ``static-full`` the static cache as it
was before it attended over its written tokens only (``sampling.TRIM_STATIC`` off: every step over
the whole length), ``compiled`` is ``generation.compile: true`` (inductor, CUDA graphs on a GPU).
The compiled mode's first call at each length is where its graph is compiled: timed apart, in
their own columns (graphs compiled, their backend seconds, the first call's wall seconds); the eager
modes warm up once, at the first length. The figure is the median of ``--repeats`` calls,
milliseconds per decoding step (the whole call divided by the new tokens: the 6-token prompts'
prefill is in it). The modes alternate within a length; each row is printed as it is measured, so
a run stopped early keeps the rows before; a mode that fails is reported in one line and left out.

``--clock cpu`` (CPU, ``--threads 1``) times this process's CPU seconds instead of the wall clock:
steadier on a machine other work shares.

``--profile LENGTH`` then profiles one call of each eager cache at that length (torch.profiler:
the top operators by self time, CUDA time on a GPU, and the operators dispatched per step).

Random weights of the benchmark's presets (benchmarks/common.py), built in memory; prompts are the
quickstart's digits. ``--precision``: ``32`` (fp32), ``bf16-mixed`` (fp32 weights under bf16
autocast, as the trainer generates), ``bf16-true`` (bf16 weights).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import PRESETS, build_tokenizer, device_name, model_config, prompts, synchronize
from benchmarks.flags import at_least, at_least_one, seconds_or_zero

MODES = ("static", "static-full", "dynamic", "compiled")
CLOCK = time.perf_counter  # --clock cpu: time.process_time


def build(preset_name: str, device: str, precision: str, longest: int):
    """The preset's random causal LM on ``device`` (room for ``longest`` positions) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    preset = PRESETS[preset_name]
    preset = dataclasses.replace(preset, n_positions=max(preset.n_positions, longest))
    tokenizer = build_tokenizer(preset)
    tokenizer.padding_side = "left"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(preset, tokenizer), dtype=dtype)
    return model.eval().requires_grad_(False), tokenizer


def autocast(device: str, precision: str):
    import torch

    if precision == "bf16-mixed":
        return torch.autocast(device.split(":")[0], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def one_call(model, enc, hf_config, mode: str, device: str, precision: str) -> tuple[float, float]:
    """(seconds by ``CLOCK``, wall seconds) of one ``generate`` in ``mode`` (synchronised)."""
    from lightning_ppo.rollout import sampling

    cache = {"compiled": "static", "static-full": "static"}.get(mode, mode)
    sampling.TRIM_STATIC = mode != "static-full"
    synchronize(device)
    start, wall = CLOCK(), time.perf_counter()
    try:
        with autocast(device, precision):
            rollout = sampling.generate(model, enc.input_ids, enc.attention_mask, hf_config, cache)
        synchronize(device)
    finally:
        sampling.TRIM_STATIC = True
    seconds, wall = CLOCK() - start, time.perf_counter() - wall
    expected = hf_config.max_new_tokens
    if rollout.response_ids.shape[1] != expected:  # the benchmark's models never stop early
        raise RuntimeError(f"generated {rollout.response_ids.shape[1]} tokens, not {expected}")
    return seconds, wall


def hf_config_for(tokenizer, length: int, compiled: bool):
    from lightning_ppo.config import GenerationConfig
    from lightning_ppo.rollout.sampling import hf_generation_config

    generation = GenerationConfig(max_new_tokens=length, compile=compiled)
    return hf_generation_config(generation, tokenizer.eos_token_id, tokenizer.pad_token_id)


def measure(model, tokenizer, args: argparse.Namespace, deadline: float) -> list[dict[str, Any]]:
    """One row per (length, mode): the warm-up call and the median ms per step after it. A mode
    that fails is reported in one line and left out from then on."""
    from lightning_ppo.rollout import compiled_decoding

    enc = tokenizer(prompts(args.batch), return_tensors="pt", padding=True).to(args.device)
    rows: list[dict[str, Any]] = []
    modes = args.modes.split(",")
    warm: set[str] = set()

    def call(mode: str, length: int) -> tuple[float, float] | None:
        try:
            return one_call(model, enc, configs[mode], mode, args.device, args.precision)
        except Exception as error:  # noqa: BLE001 - one line, and the other modes go on
            print(
                f"# {mode} at {length} new tokens failed: {type(error).__name__}: {error}"[:400], flush=True
            )
            modes.remove(mode)
            return None

    for length in (int(n) for n in args.lengths.split(",")):
        if time.monotonic() > deadline:
            print(f"# length {length} skipped: past the budget", flush=True)
            continue
        configs = {mode: hf_config_for(tokenizer, length, mode == "compiled") for mode in modes}
        row_of = {mode: {"length": length, "mode": mode, "seconds": []} for mode in modes}
        for mode in list(modes):  # warm-up: the compiled mode's compilations; the eager ones' first call
            row_of[mode].update(first_call_s=0.0, graphs=0, compile_s=0.0)
            if mode != "compiled" and mode in warm:
                continue
            warm.add(mode)
            before = (compiled_decoding.COMPILATIONS.count, compiled_decoding.COMPILATIONS.seconds)
            first = call(mode, length)
            if first is not None:
                row_of[mode].update(
                    first_call_s=first[1],
                    graphs=compiled_decoding.COMPILATIONS.count - before[0],
                    compile_s=compiled_decoding.COMPILATIONS.seconds - before[1],
                )
        for _ in range(args.repeats):  # the modes alternate
            for mode in list(modes):
                timed = call(mode, length)
                if timed is not None:
                    row_of[mode]["seconds"].append(timed[0])
        for mode, row in row_of.items():
            if mode in modes and row["seconds"]:
                row["ms_per_step"] = 1000 * statistics.median(row["seconds"]) / length
                rows.append(row)
                print_row(row, flush=True)
    return rows


HEADER = "| new tokens | mode | ms / step | x static | graphs compiled | compile s | first call s |"


def print_row(row: dict[str, Any], flush: bool = False, static: float | None = None) -> None:
    ratio = f"{row['ms_per_step'] / static:.2f}" if static else ""
    compile_s = f"{row['compile_s']:.1f}" if row["graphs"] else ""
    first = f"{row['first_call_s']:.2f}" if row["first_call_s"] else ""
    print(
        f"| {row['length']} | {row['mode']} | {row['ms_per_step']:.3f} | {ratio} | {row['graphs']} | "
        f"{compile_s} | {first} |",
        flush=flush,
    )


def profile(model, tokenizer, args: argparse.Namespace) -> None:
    """One call of each eager cache at ``args.profile`` new tokens under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    enc = tokenizer(prompts(args.batch), return_tensors="pt", padding=True).to(args.device)
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for cache in ("static", "static-full", "dynamic"):
        config = hf_config_for(tokenizer, args.profile, False)
        one_call(model, enc, config, cache, args.device, args.precision)  # warm
        with profile(activities=activities) as prof:
            one_call(model, enc, config, cache, args.device, args.precision)
        events = prof.key_averages()
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        per_step = ops / args.profile
        print(f"\n## profile: {cache} cache, {args.profile} new tokens; {per_step:.0f} aten ops per step")
        print(events.table(sort_by=sort, row_limit=18, max_name_column_width=60))
    sys.stdout.flush()
    del torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--preset", default=None, help="tiny-llama on cpu, llama-0.5b on cuda")
    parser.add_argument("--batch", type=at_least_one, default=None, help="8 on cpu, 64 on cuda")
    parser.add_argument("--lengths", default="32,256,1024", help="new tokens, comma-separated")
    parser.add_argument("--modes", default=",".join(MODES), help="of static, dynamic, compiled")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls per mode and length: 3 on cpu, 1 on cuda"
    )
    parser.add_argument("--precision", default=None, help="32 on cpu, bf16-mixed on cuda; or bf16-true")
    parser.add_argument("--threads", type=at_least(0), default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--profile", type=at_least(0), default=0, help="profile each eager cache at this length"
    )
    parser.add_argument(
        "--budget", type=seconds_or_zero, default=0, help="seconds; no new length after it (0: none)"
    )
    parser.add_argument(
        "--clock",
        default="wall",
        help="wall, or cpu: this process's CPU seconds (CPU, 1 thread: for a shared machine)",
    )
    parser.add_argument("--out", default=None, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.preset = args.preset or ("llama-0.5b" if cuda else "tiny-llama")
    args.batch = args.batch or (64 if cuda else 8)
    args.repeats = args.repeats or (1 if cuda else 3)
    args.precision = args.precision or ("bf16-mixed" if cuda else "32")
    if args.precision not in ("32", "bf16-mixed", "bf16-true"):
        parser.error(f"--precision must be 32, bf16-mixed or bf16-true, got {args.precision!r}")
    if args.clock not in ("wall", "cpu") or (args.clock == "cpu" and (cuda or args.threads != 1)):
        parser.error("--clock must be wall, or cpu on a CPU with --threads 1")
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter

    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.monotonic()
    deadline = start + args.budget if args.budget else float("inf")
    longest = max(int(n) for n in args.lengths.split(",")) + 64
    model, tokenizer = build(args.preset, args.device, args.precision, longest)
    print(
        f"# {args.preset}, batch {args.batch}, {args.precision}, {device_name(args.device)}; torch "
        f"{torch.__version__}, transformers {transformers.__version__}; median of {args.repeats} calls, "
        f"{'CPU' if args.clock == 'cpu' else 'wall'} time",
        flush=True,
    )
    print(HEADER)
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    rows = measure(model, tokenizer, args, deadline)
    print("\nby length, against the static cache:")
    print(HEADER)
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        static = next((r for r in rows if r["length"] == row["length"] and r["mode"] == "static"), None)
        print_row(row, static=static["ms_per_step"] if static else None)
    if args.profile:
        profile(model, tokenizer, args)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"\n# {time.monotonic() - start:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
