"""``make gpu-check``: what only a GPU shows, in one run of under 8 minutes on one H100/H200.

    make gpu-check                                  # with python3; PYTHON=... names another
    python -m benchmarks.gpu_check --out runs/gpu-check --budget 480

Runs with the interpreter it is given, as it is: no venv, no downloads (a GPU machine may be
offline). Stages, each given a share of ``--budget`` seconds and skipped, saying so, when
too little is left:

1. side by side (tiny models, untimed): the GPU-only tests (``tests/test_gpu.py``: every model family
   under every precision, LoRA; ``tests/test_nccl_gpu.py``: a sync over NCCL, on two GPUs with vLLM),
   and the quickstart on ``cuda`` as configured (fp32,
   ``--quickstart-iterations``) beside every other example config for a few iterations in bf16-mixed;
2. the GSM8K recipe's shapes (``configs/gsm8k_ppo.yaml``): a random-weight model of Qwen2.5-0.5B's
   config, 64 prompts of 200 tokens, responses of 256 and then 512 tokens, one PPO epoch over 4
   minibatches: lightning_ppo and the floor, seconds per iteration, generated tokens per second and
   peak memory;
3. the benchmark's CUDA table: llama-0.5b, bf16-mixed, batch 64 x 32 new tokens: lightning_ppo
   eager and compiled, the floor and TRL (if importable), each row's time against TRL's;
4. the same on variable lengths (``bench-64x32-variable``, the benchmark's variable-length table):
   64 prompts of 8 to 64 tokens, responses cut at 1 to 32 tokens (each prompt's scheduled length,
   the same in every variant, TRL's included): TRL, lightning_ppo compiled and eager, the floor;
5. the same at batch 256 x 256 new tokens: lightning_ppo compiled (decoding and loss) and eager, and
   the floor; each row's iteration and generation against the floor's (issue 43's targets: 0.8x, 0.5x);
6. decoding alone (``benchmarks.decoding``, where it exists): ms per step against length;
7. ``fit-end``: the whole process's peak host RSS, read from outside, of lightning_ppo and the floor at
   64 x 32 (``benchmarks.fit_end_memory``; the target: at most 1.2x the floor's);
8. ``selfcheck``: ``lightning-ppo selfcheck`` on the device under bf16-mixed: does training land on the
   exact KL-regularised optimum there (docs/selfcheck.md)? Its gaps in the row's note; FAILED on a FAIL.
9. ``sync``: one weight sync of a 0.5B policy into a vLLM server, vLLM's NCCL transfer against ours
   (``benchmarks.sync_transports``: seconds per sync, the first apart); one skipped row where this
   interpreter has no vLLM, and the NCCL row skipped on one GPU.

``--stages`` picks and orders them (a short lease: the rows that matter first).

``--accelerator cpu`` runs the same stages on the CPU (the benchmark on a tiny Llama), to try the
check itself where no GPU is at hand. It ends with one table (s / iteration, peak GPU memory, peak
host RSS, MFU or the run's score) and writes it, with every log, to ``--out``. Exit status 1 when
anything failed; without CUDA (and ``--accelerator cuda``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning.pytorch import Callback

from benchmarks.flags import at_least_one, seconds

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
# tiny checkpoints the example configs load by path, as `make tiny` writes them
TINY = {
    "tiny-digits": ["--alphabet", "0123456789="],
    "tiny-reward": ["--kind", "reward", "--alphabet", "0123456789=", "--seed", "1"],
    "tiny-chars": [],
}
# in run order: what the targets compare first, should the time run out
MAIN_VARIANTS = ("lightning_ppo", "floor", "trl", "lightning_ppo_compiled")
LONG_VARIANTS = ("lightning_ppo", "floor")
# 256 x 256's, in run order: the targets are the compiled variant's generation and iteration
# against the floor's
LONG_256_VARIANTS = ("lightning_ppo_compiled", "floor", "lightning_ppo")
# The variable-length stage's, in run order: the target is the compiled variant's time against TRL's
VARIABLE_VARIANTS = ("trl", "lightning_ppo_compiled", "lightning_ppo", "floor")
# Each stage's share of the budget (at most: a stage that ends early leaves its time to the next).
STAGE_SHARES = {
    "checks": 0.15,
    "recipe": 0.5,
    "bench-64x32": 0.45,
    "bench-64x32-variable": 0.45,
    "bench-256x256": 0.3,
    "decoding": 0.15,
    "fit-end": 0.2,
    "selfcheck": 0.15,
    "sync": 0.25,
}
# The GSM8K recipe (configs/gsm8k_ppo.yaml): batch 64, ~200-token prompts, 1 epoch x 4 minibatches
RECIPE = ["--configs", "qwen2.5-0.5b", "--batch-size", "64", "--prompt-length", "200"]
RECIPE += ["--ppo-epochs", "1", "--minibatches", "4", "--iterations", "2"]
RECIPE_LENGTHS = (256, 512)
# The tests that need CUDA: test_gpu.py, and the CUDA cases of the others (their ids say cuda)
GPU_TESTS = ["tests/test_gpu.py", "tests/test_faults.py", "tests/test_nccl_gpu.py", "-k", "cuda"]
# the benchmark's stages on the CPU: a tiny Llama, one thread, small batches (these flags come last: they win)
CPU_TRIAL = ["--device", "cpu", "--configs", "tiny-llama", "--precisions", "bf16-mixed", "--threads", "1"]
CPU_TRIAL += ["--batch-size", "8", "--response-length", "8", "--minibatches", "2", "--ppo-epochs", "2"]
# The variable-length table at the main table's shapes (batch, epochs, minibatches) and precision;
# its first iteration (the compiled variant's compilations) is not counted.
VARIABLE = ["--variable-config", "llama-0.5b", "--variable-precision", "bf16-mixed"]
VARIABLE += ["--variable-response", "32", "--variable-iterations", "4"]
VARIABLE_TRIAL = ["--variable-config", "tiny-llama", "--variable-response", "8", "--variable-iterations", "2"]


@dataclass
class Line:
    """One row of the closing table."""

    stage: str
    what: str
    precision: str
    status: str
    s_per_it: float | None = None
    gpu_mib: float | None = None
    rss_mib: float | None = None
    note: str = ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"), help="folder for the logs and table")
    p.add_argument("--budget", type=seconds, default=480, help="seconds for the whole check")
    p.add_argument("--quickstart-iterations", type=at_least_one, default=100)
    p.add_argument(
        "--stages",
        default=",".join(STAGE_SHARES),
        help=f"comma-separated, in run order, of {list(STAGE_SHARES)}",
    )
    p.add_argument("--config-iterations", type=at_least_one, default=3)
    p.add_argument(
        "--accelerator",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: every stage on the CPU with a tiny benchmark model, to try the check itself",
    )
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one config in this process
    p.add_argument("--precision", default="bf16-mixed", help=argparse.SUPPRESS)
    p.add_argument("--iterations", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- one config, in a child
class IterationTimer(Callback):
    """Wall seconds of each PPO iteration (one training batch), the device synchronised at its end."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: object) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: object) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)

    def steady(self) -> float | None:
        """The median iteration, the first (warm-up) left out."""
        counted = self.seconds[1:] or self.seconds
        return statistics.median(counted) if counted else None


def run_one(
    config: str, precision: str | None, iterations: int, root: str, result: str, accelerator: str = "cuda"
) -> None:
    """``lightning-ppo fit`` of one example config on one GPU, in this process; writes what it saw."""
    import torch

    from benchmarks import common
    from lightning_ppo.cli import main

    args = ["fit", "--config", config, "--trainer.accelerator", accelerator, "--trainer.devices", "1"]
    args += ["--trainer.limit_train_batches", str(iterations), "--trainer.default_root_dir", root]
    args += ["--trainer.enable_progress_bar", "false", f"--trainer.callbacks+={__name__}.IterationTimer"]
    if "data_parallel_size" in Path(config).read_text():  # FSDP2's mesh, on the one GPU
        args += ["--trainer.strategy.init_args.data_parallel_size", "1"]
    if precision:
        args += ["--trainer.precision", precision, "--trainer.limit_val_batches", "0"]
    start = time.perf_counter()
    cli = main(args)
    seconds = time.perf_counter() - start
    if not hasattr(cli, "trainer"):
        raise SystemExit(f"lightning-ppo fit exited with {cli}")
    module, metrics = cli.trainer.lightning_module, cli.trainer.callback_metrics
    timer = next(c for c in cli.trainer.callbacks if isinstance(c, IterationTimer))
    done = {
        "iterations": module.iteration,
        "fit_s": seconds,
        "s_per_it": timer.steady(),
        "gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        "rss_mib": common.peak_rss_mib(),
        "score": float(metrics["objective/scores"]) if "objective/scores" in metrics else None,
        "eval": float(metrics["eval/scores"]) if "eval/scores" in metrics else None,
    }
    Path(result).write_text(json.dumps(done))


# ----------------------------------------------------------------------------- stages
def child_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}


def run_logged(command: list[str], log: Path, timeout: float, **env: str) -> str | None:
    """Run ``command`` from the project root, output to ``log``; None if it succeeded, else why not.
    On its timeout the command's whole process group is killed: the benchmark's runs are its
    children, and one left running would hold the GPU through the next stage."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, env={**child_env(), **env}, stdout=out, stderr=out, start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # timed out, or this process interrupted: a Ctrl-C no longer reaches the new session
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if timed_out:
        return f"timed out after {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    last = (log.read_text().strip().splitlines() or ["no output"])[-1]
    return f"exit {proc.returncode}: {last[:160]}"


def gpu_tests(out: Path, timeout: float) -> list[Line]:
    log = out / "tests.log"
    failure = run_logged([sys.executable, "-m", "pytest", "-q", "-rs", *GPU_TESTS], log, timeout)
    summary = re.findall(r"^=*\s*(\d+ \w+.*) in [\d.]+s", log.read_text(), flags=re.M)
    status = "ok" if failure is None else "FAILED"
    return [Line("tests", " ".join(GPU_TESTS), "all", status, note=(summary or [failure or ""])[-1])]


def configs(out: Path, timeout: float, args: argparse.Namespace) -> list[Line]:
    """Every example config at once, each in its own process on the one GPU."""
    for name, flags in TINY.items():
        target = ROOT / "checkpoints" / name
        if not (target / "config.json").exists():
            from lightning_ppo.cli import make_tiny_main

            make_tiny_main(["--out", str(target), *flags])
    runs = {"quickstart": (None, args.quickstart_iterations)}
    others = [p.stem for p in sorted(CONFIGS.glob("*.yaml")) if p.stem != "quickstart"]
    from_hub = {name: hub_model(CONFIGS / f"{name}.yaml") for name in others}
    skipped = [
        Line(
            "config",
            name,
            "bf16-mixed",
            "skipped",
            note=f"loads {model} from the hub (tests/test_gsm8k.py: offline)",
        )
        for name, model in from_hub.items()
        if model
    ]
    runs |= {name: ("bf16-mixed", args.config_iterations) for name in others if not from_hub[name]}
    procs = {}
    for name, (precision, n) in runs.items():
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--one", str(CONFIGS / f"{name}.yaml")]
        command += ["--iterations", str(n), "--root", str(out / "runs" / name)]
        command += ["--result", str(out / f"{name}.json"), "--precision", precision or ""]
        command += ["--accelerator", args.accelerator]
        log = (out / f"config-{name}.log").open("w")
        env = {**child_env(), "OMP_NUM_THREADS": "1"}
        procs[name] = (subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log), log)
    deadline, lines = time.monotonic() + timeout, []
    for name, (proc, log) in procs.items():
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.close()
        lines.append(config_line(out, name, runs[name][0] or "32 (as configured)", code))
    return lines + skipped


def hub_model(config: Path) -> str | None:
    """The policy ``config`` names by a hub name (a GPU machine may be offline), else None."""
    import yaml

    init = (yaml.safe_load(config.read_text()).get("model") or {}).get("init_args") or {}
    policy = str(init.get("policy", ""))
    return policy if policy and not (ROOT / policy).exists() and not Path(policy).exists() else None


def config_line(out: Path, name: str, precision: str, code: int | str) -> Line:
    result = out / f"{name}.json"
    if code != 0 or not result.exists():
        tail = (out / f"config-{name}.log").read_text().strip().splitlines() or ["no output"]
        return Line("config", name, precision, "FAILED", note=f"{code}: {tail[-1][:120]}")
    r = json.loads(result.read_text())
    note = f"{r['iterations']} its, fit {r['fit_s']:.0f} s"
    note += f", score {r['score']:.3f}" if r["score"] is not None else ""
    note += f", eval {r['eval']:.3f}" if r["eval"] is not None else ""
    return Line("config", name, precision, "ok", r["s_per_it"], r["gpu_mib"], r["rss_mib"], note)


def bench(
    out: Path, name: str, timeout: float, variants: tuple[str, ...], extra: list[str], group: str = "main"
) -> list[Line]:
    """One benchmark table (``benchmarks.bench``), its runs as rows: the main table, or with
    ``group="variable"`` the variable-length one (``extra`` names its shapes)."""
    from benchmarks import report

    known = [v for v in variants if v in (*report.VARIANTS, report.DYNAMIC, report.COMPILED)]
    folder, log = out / name, out / f"{name}.log"
    command = [sys.executable, "-m", "benchmarks.bench", "--rounds", "1", "--no-scaling", "--no-count-ops"]
    if group == "main":
        command += ["--no-variable", "--variants", ",".join(known)]
    else:
        command += ["--no-main", "--variable", "--variable-variants", ",".join(known)]
    command += ["--out", str(folder), *extra]  # ops are counted on CPU (docs/performance.md), not here
    failure = run_logged(command, log, timeout)
    results = folder / "results.json"
    if not results.exists():
        return [Line(name, ",".join(known), "bf16-mixed", "FAILED", note=failure or "no results")]
    records = [r for r in json.loads(results.read_text()) if r["group"] == group]
    lines = [bench_line(name, r) for r in records]
    against(lines, records, "trl")
    against(lines, records, "floor")
    ran = {r["spec"]["variant"] for r in records}
    return lines + [not_run(name, v, failure, log) for v in known if v not in ran]


def bench_line(name: str, r: dict) -> Line:
    """A benchmark run's row: its steady seconds per iteration, memory, and what the note says."""
    steady = r["iteration_s"][1:] or r["iteration_s"]
    seconds = statistics.median(steady) if steady else None  # as the benchmark's report
    spec, mfu = r["spec"], r.get("mfu")
    variable = spec.get("workload") == "variable"
    note = f"training RSS {r.get('train_rss_mib') or r['peak_rss_mib']:.0f} MiB"
    # MFU counts the padded rectangle of fixed prompts: on variable lengths, the real share instead
    note += f", MFU {100 * mfu:.1f} %" if mfu is not None and not variable else ""
    if variable and r.get("tokens_computed"):
        note += f", policy tokens real {r['tokens_real'] / r['tokens_computed']:.0%} of computed"
    rate = generated_per_s(r)
    note += f", generated {rate:,.0f} tok/s" if rate else ""
    note = r["error"][:120] if r["error"] else note
    status = "FAILED" if r["error"] else "ok"
    length = f"1-{spec['response_length']}" if variable else spec["response_length"]
    what = f"{spec['variant']} {spec['preset']} b{spec['batch_size']} x {length}"
    what += f", prompts 8-{2 * spec['response_length']}" if variable else ""
    what += f", prompts {spec['prompt_length']}" if spec.get("prompt_length") else ""
    memory = r["peak_gpu_mib"], r["peak_rss_mib"]
    return Line(name, what, spec["precision"], status, seconds, *memory, note)


def against(lines: list[Line], records: list[dict], reference: str) -> None:
    """Each row's seconds per iteration against ``reference``'s in the same table, first in its note;
    against the floor also its generation's seconds (the ``generate`` phase), where both timed it."""
    rows = [(line, r) for line, r in zip(lines, records, strict=True) if line.s_per_it]
    rows = [(line, r) for line, r in rows if line.status == "ok"]
    ref = next(((line, r) for line, r in rows if r["spec"]["variant"] == reference), None)
    if ref is None:
        return
    for line, r in rows:
        if r["spec"]["variant"] in (reference, "trl"):
            continue
        name = "TRL" if reference == "trl" else reference
        said = f"{line.s_per_it / ref[0].s_per_it:.2f}x {name}"
        ours, theirs = generate_s(r), generate_s(ref[1])
        said += f" (generation {ours / theirs:.2f}x)" if reference == "floor" and ours and theirs else ""
        line.note = f"{said}, {line.note}"


def not_run(name: str, variant: str, failure: str | None, log: Path) -> Line:
    """The row of a variant the benchmark did not run: TRL not importable, or the stage's time out."""
    said = log.read_text().splitlines() if variant == "trl" and log.exists() else []
    said = [x for x in said if "not importable" in x]
    return Line(name, variant, "", "skipped", note=(said or [f"not run: {failure or 'see ' + log.name}"])[0])


def generate_s(result: dict) -> float | None:
    """The ``generate`` phase's seconds, the median of the iterations after the first, where the run
    timed its phases."""
    seconds = [phase["generate"] for phase in result.get("phases", []) if "generate" in phase]
    seconds = seconds[1:] or seconds
    return statistics.median(seconds) if seconds else None


def generated_per_s(result: dict) -> float | None:
    """Generated tokens per second of generation: rows x new tokens over :func:`generate_s`."""
    seconds, width, rows = generate_s(result), result.get("response_width"), result["spec"]["batch_size"]
    return rows * width / seconds if seconds and width else None


# ----------------------------------------------------------------------------- the table
def render(lines: list[Line], facts: list[str]) -> str:
    def f(value: float | None, digits: int) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    header = ["stage", "what", "precision", "status", "s / it", "peak GPU MiB", "peak RSS MiB", "note"]
    rows = [
        [x.stage, x.what, x.precision, x.status]
        + [f(x.s_per_it, 3), f(x.gpu_mib, 0), f(x.rss_mib, 0), x.note]
        for x in lines
    ]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join([*facts, "", *table, ""])


def versions(accelerator: str) -> str:
    import lightning
    import peft
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if accelerator == "cuda" else "CPU (a trial of the check)"
    return (
        f"{device}; torch {torch.__version__}, lightning {lightning.__version__}, transformers "
        f"{transformers.__version__}, peft {peft.__version__}; python {sys.version.split()[0]}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        run_one(args.one, args.precision or None, args.iterations, args.root, args.result, args.accelerator)
        return 0
    import torch

    if args.accelerator == "cuda" and not torch.cuda.is_available():
        print("gpu-check: CUDA is not available on this machine: nothing to check (the GPU tests skip).")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    facts = [f"gpu-check {time.strftime('%Y-%m-%d %H:%M %Z')}: {versions(args.accelerator)}"]
    print(facts[0], flush=True)
    # measured on an H200 (with the dynamic-cache variant, since dropped): checks 54 s, bench-64x32
    # 296 s, bench-256x256 152 s
    stages = args.stages.split(",")
    unknown = sorted(set(stages) - set(STAGE_SHARES))
    if unknown:
        raise SystemExit(f"gpu-check: --stages: unknown {unknown}; expected some of {list(STAGE_SHARES)}")
    lines: list[Line] = []
    for stage in stages:
        left = args.budget - (time.monotonic() - start)
        allowed = left if stage == stages[-1] else min(left, STAGE_SHARES[stage] * args.budget)
        if allowed < 30:
            lines.append(Line(stage, "", "", "skipped", note=f"{left:.0f} s of the budget left"))
            continue
        t0 = time.monotonic()
        lines += run_stage(stage, out, allowed, args)
        print(f"{stage}: {time.monotonic() - t0:.0f} s", flush=True)
        write_table(out, lines, facts)  # after every stage: a lease that ends early keeps the rows so far
    facts.append(f"whole check: {time.monotonic() - start:.0f} s; logs in {out}")
    print("\n" + write_table(out, lines, facts))
    return 1 if any(x.status == "FAILED" for x in lines) else 0


def write_table(out: Path, lines: list[Line], facts: list[str]) -> str:
    text = render(lines, facts)
    (out / "gpu-check.md").write_text(text)
    (out / "gpu-check.json").write_text(json.dumps([asdict(x) for x in lines], indent=1))
    return text


def run_stage(stage: str, out: Path, allowed: float, args: argparse.Namespace) -> list[Line]:
    if stage == "checks":  # the tests and the configs side by side: tiny models, untimed
        with ThreadPoolExecutor(2) as pool:
            tests = pool.submit(gpu_tests, out, allowed)
            lines = configs(out, allowed, args)
            return tests.result() + lines
    device = ["--device", "cuda"] if args.accelerator == "cuda" else CPU_TRIAL
    if stage == "recipe":
        return recipe(out, allowed, device)
    if stage == "decoding":
        return decoding(out, allowed, args.accelerator)
    kept = ["--checkpoints", str(out / "checkpoints")]  # llama-0.5b's built once for both 64 x 32 stages
    if stage == "bench-64x32":
        return bench(out, stage, allowed, MAIN_VARIANTS, ["--iterations", "3", *kept, *device])
    if stage == "bench-64x32-variable":
        trial = VARIABLE_TRIAL if args.accelerator == "cpu" else []
        extra = [*VARIABLE, *kept, *device, *trial]
        return bench(out, stage, allowed, VARIABLE_VARIANTS, extra, group="variable")
    if stage == "fit-end":
        return fit_end(out, allowed, args.accelerator)
    if stage == "selfcheck":
        return selfcheck(out, allowed, args.accelerator)
    if stage == "sync":
        return sync_transports(out, allowed, args.accelerator)
    long = ["--iterations", "2", "--batch-size", "256", "--response-length", "256"]
    return bench(out, stage, allowed, LONG_256_VARIANTS, [*long, *device])


def recipe(out: Path, allowed: float, device: list[str]) -> list[Line]:
    """The GSM8K recipe's shapes at each response length, lightning_ppo beside the floor."""
    trial = device != ["--device", "cuda"]  # the CPU trial: the tiny Llama, 1/16 of each length
    if trial:
        device = [*device, "--prompt-length", "200", "--batch-size", "8", "--ppo-epochs", "1"]
    lines: list[Line] = []
    deadline = time.monotonic() + allowed
    for length in RECIPE_LENGTHS:
        left = deadline - time.monotonic()
        if left < 30:
            lines.append(Line("recipe", f"r{length}", "", "skipped", note=f"{left:.0f} s of the stage left"))
            continue
        extra = [*RECIPE, "--response-length", str(length), "--precisions", "bf16-mixed", *device]
        extra += ["--response-length", str(length // 16)] if trial else []  # after CPU_TRIAL's 8
        extra += ["--checkpoints", str(out / "checkpoints")]  # built once for both lengths
        lines += bench(out, f"recipe-{length}", left, LONG_VARIANTS, extra)
    return lines


def decoding(out: Path, allowed: float, accelerator: str) -> list[Line]:
    """``benchmarks.decoding``'s table (ms per decoding step by cache and length), as its log."""
    if importlib.util.find_spec("benchmarks.decoding") is None:
        return [Line("decoding", "benchmarks.decoding", "", "skipped", note="not in this tree")]
    log = out / "decoding.log"
    command = [sys.executable, "-m", "benchmarks.decoding", "--device", accelerator]
    failure = run_logged(command, log, allowed)
    status = "ok" if failure is None else "FAILED"
    return [Line("decoding", "benchmarks.decoding", "bf16-mixed", status, note=failure or f"table in {log}")]


def selfcheck(out: Path, allowed: float, accelerator: str) -> list[Line]:
    """``lightning-ppo selfcheck`` on ``accelerator`` under bf16-mixed: its verdict and gaps (its
    ``selfcheck.json``), the run's seconds in the note."""
    folder, log = out / "selfcheck", out / "selfcheck.log"
    (folder / "selfcheck.json").unlink(missing_ok=True)  # a last check's must not pass for this one's
    command = [sys.executable, "-m", "lightning_ppo.cli", "selfcheck", "--out", str(folder), "--no-plot"]
    command += ["--trainer.accelerator", accelerator, "--trainer.precision", "bf16-mixed"]
    failure = run_logged(command, log, allowed)
    if not (folder / "selfcheck.json").exists():
        return [
            Line("selfcheck", "lightning-ppo selfcheck", "bf16-mixed", "FAILED", note=failure or "no result")
        ]
    r = json.loads((folder / "selfcheck.json").read_text())
    if r["stopped"] is not None:
        return [Line("selfcheck", r["setup"], "bf16-mixed", "FAILED", note=f"stopped: {r['stopped'][:120]}")]
    gaps = ", ".join(
        f"{name} {r[name]['exact']:.4f} -> {r[name]['reached']:.4f} ({r[name]['gap']:+.4f}, "
        f"band [{r[name]['low']:+.4f}, {r[name]['high']:+.4f}])"
        for name in ("reward", "kl", "objective")
    )
    verdict = "PASS" if r["passed"] else "FAIL"
    sampling = "" if r.get("sampling") is None else f", sampling z {r['sampling']['z']:+.2f}"
    note = f"{verdict} in {r['seconds']:.0f} s: {gaps}{sampling}"
    return [Line("selfcheck", r["setup"], "bf16-mixed", "ok" if r["passed"] else "FAILED", note=note)]


def sync_transports(out: Path, allowed: float, accelerator: str) -> list[Line]:
    """``benchmarks.sync_transports``: a 0.5B policy's sync, each transport a row (seconds per sync in
    the s / it column), NCCL's against ours in its note; one skipped row where it cannot run."""
    if accelerator != "cuda":
        return [Line("sync", "memory,nccl", "", "skipped", note="GPUs only (CPU syncs: benchmarks.servers)")]
    rows, log = out / "sync.json", out / "sync.log"
    rows.unlink(missing_ok=True)  # a last check's must not pass for this one's
    command = [
        sys.executable,
        "-m",
        "benchmarks.sync_transports",
        "--out",
        str(out / "sync"),
        "--json",
        str(rows),
    ]
    failure = run_logged(command, log, allowed)
    said = log.read_text().strip().splitlines() if log.exists() else []
    if said and "skipped:" in said[-1] and not rows.exists():
        return [Line("sync", "memory,nccl", "", "skipped", note=said[-1].split("skipped: ", 1)[1])]
    if not rows.exists():
        return [Line("sync", "memory,nccl", "", "FAILED", note=failure or "no results")]
    records = json.loads(rows.read_text())
    ours = next((r["sync_s"] for r in records if r["transport"] == "memory" and r["sync_s"]), None)
    lines = []
    for r in records:
        note = r["note"] or f"{r['gib']:.2f} GiB per sync; first (joined, checked) {r['first_s']:.2f} s"
        if r["transport"] != "memory" and r["sync_s"] and ours:
            note = f"{r['sync_s'] / ours:.2f}x memory, {note}"
        what = f"qwen2.5-0.5b sync, {r['transport']}"
        lines.append(Line("sync", what, "bf16", r["status"], r["sync_s"], note=note))
    return lines


def fit_end(out: Path, allowed: float, accelerator: str) -> list[Line]:
    """``benchmarks.fit_end_memory``: the whole process's peak host RSS, read from outside, of
    lightning_ppo and the floor (the target: at most 1.2x the floor's)."""
    shape = ["--preset", "llama-0.5b", "--precision", "bf16-mixed"]
    shape += ["--batch-size", "64", "--response-length", "32"]
    if accelerator == "cpu":
        shape = ["--preset", "tiny-llama", "--batch-size", "8", "--response-length", "8", "--threads", "1"]
    rows = out / "fit-end.json"
    command = [sys.executable, "-m", "benchmarks.fit_end_memory", "--device", accelerator, *shape]
    command += ["--variants", "floor,lightning_ppo", "--json", str(rows)]
    failure = run_logged(command, out / "fit-end.log", allowed)
    if failure or not rows.exists():
        return [Line("fit-end", "floor,lightning_ppo", "", "FAILED", note=failure or "no results")]
    lines = []
    for r in json.loads(rows.read_text()):
        note = f"{r['x_floor']:.2f}x the floor's peak RSS (whole process, from outside)"
        note += f"; training peak {r['train_mib']:.0f} MiB"
        what = f"{r['variant']} {r['preset']} b{r['batch_size']} x {r['response_length']}"
        memory = r["gpu_mib"] or None, r["outside_mib"]
        lines.append(Line("fit-end", what, r["precision"], "ok", None, *memory, note))
    return lines


if __name__ == "__main__":
    sys.exit(main())
