"""The benchmark driver: the same PPO work three ways, alternated, each run in its own subprocess.

    python -m benchmarks.bench               # CPU: small and medium GPT-2, fp32 and bf16-mixed, + scaling
    python -m benchmarks.bench --threads 1   # the same on a machine shared with other jobs
    python -m benchmarks.bench --quick       # smoke run: tiny model, lightning_ppo (both critics), floor
    python -m benchmarks.bench --configs medium --precisions 32 --no-scaling \
        --variants lightning_ppo,lightning_ppo_vllm,trl,floor   # the generation engines, hf vs vllm

Variants: ``lightning_ppo`` (the real Trainer and PPOLightningModule, ``run_lightning.py``), ``trl``
(TRL 1.12.0's PPO trainer, ``run_trl.py``; skipped when TRL is not importable) and ``floor`` (bare
PyTorch, ``floor.py``), plus ``lightning_ppo_shared`` (one backbone for policy and critic) and
``lightning_ppo_vllm`` (``generation.engine: vllm``, run with the interpreter of a vLLM environment:
``--vllm-python``, else ``$LIGHTNING_PPO_VLLM_PYTHON``, else ``.venv-vllm/bin/python``; skipped with
the reason printed where that interpreter or ``import vllm`` is missing, and on CPU for a model
preset whose head size vLLM's CPU attention has no kernel for); ``lightning_ppo_dynamic`` (HF's
dynamic generation cache instead of the default static one) and ``lightning_ppo_compiled``
(``ppo.torch_compile``: the loss passes compiled; its first iteration, not counted, compiles) only
when named (``--variable-variants`` names them for the variable-length table, ``--no-main`` runs
that table alone: gpu_check's ``bench-64x32-variable``). For every (config, precision)
the variants run one after another in a rotating order (``--rounds`` times), so that drift in
the machine's speed hits all of them alike.
With CUDA (``--device auto`` finds it) the default is a ~0.5B Llama-style model in bf16-mixed, with
peak GPU memory and model FLOPs utilisation; ``--device cuda`` without CUDA skips cleanly.
Checkpoints are built from configs in a temporary folder: nothing is downloaded. The report
(``report.py``) is printed and written with the raw results and every run's log to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from subprocess import TimeoutExpired, run

from benchmarks import common, report
from benchmarks.flags import at_least, at_least_one, positive, seconds, seconds_or_zero

ROOT = Path(__file__).resolve().parents[1]
RUNNERS = {
    "lightning_ppo": "benchmarks.run_lightning",
    "trl": "benchmarks.run_trl",
    "floor": "benchmarks.floor",
    "lightning_ppo_shared": "benchmarks.run_lightning",
    "lightning_ppo_vllm": "benchmarks.run_lightning",
    "lightning_ppo_padded": "benchmarks.run_lightning",
    "lightning_ppo_budget": "benchmarks.run_lightning",
    report.DYNAMIC: "benchmarks.run_lightning",
    report.COMPILED: "benchmarks.run_lightning",
}
# The generation engine of each lightning_ppo variant (RunSpec.engine); "hf" where not named.
ENGINES = {"lightning_ppo_vllm": "vllm"}
VLLM_VARIANT = "lightning_ppo_vllm"
# The vLLM environment `make test-vllm` builds; --vllm-python or this variable name another.
VLLM_PYTHON_ENV = "LIGHTNING_PPO_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@dataclass
class Settings:
    """What to run; ``--quick``, CPU and CUDA each have their defaults, any flag overrides them."""

    configs: str = "small,medium"
    precisions: str = "32,bf16-mixed"
    variants: str = ",".join(report.VARIANTS)
    iterations: int = 6
    batch_size: int = 64
    minibatches: int = 4
    ppo_epochs: int = 4
    response_length: int = 32
    prompt_length: int = 0  # tokens per prompt of the main table; 0: the quickstart's 6
    threads: int = 0  # 0: torch's default
    main: bool = True  # the main table (off: only the other tables, e.g. gpu_check's variable stage)
    scaling: bool = True
    scaling_config: str = "medium"
    scaling_precision: str = "32"
    # the variable-length table: prompts of 8 to 2 x variable_response tokens, responses cut at 1
    # to variable_response tokens, in variable_precision; lightning_ppo padded / default / token
    # budget, the floor (TRL and lightning_ppo_compiled where named in variable_variants)
    variable: bool = True
    variable_variants: str = ",".join(report.VARIABLE_VARIANTS)
    variable_precision: str = "32"
    variable_config: str = "medium"
    variable_response: int = 128
    variable_iterations: int = 4
    # one more run per main-table point under benchmarks.op_count (aten ops and host reads per
    # iteration, the first left out), not timed
    count_ops: bool = True
    count_iterations: int = 3


DEFAULTS = {
    "cpu": Settings(),
    "cuda": Settings(
        configs="llama-0.5b",
        precisions="bf16-mixed",
        iterations=8,
        scaling_config="llama-0.5b",
        scaling_precision="bf16-mixed",
        variable_config="llama-0.5b",
    ),
    "quick": Settings(
        configs="tiny",
        precisions="32",
        variants="lightning_ppo,floor,lightning_ppo_shared",
        iterations=2,
        batch_size=8,
        minibatches=2,
        ppo_epochs=2,
        response_length=8,
        threads=1,
        scaling=False,
        variable_config="tiny",
        variable_response=16,
        variable_iterations=2,
        count_iterations=2,
    ),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 iterations, no scaling")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--configs", help=f"comma-separated model presets of {sorted(common.PRESETS)}")
    p.add_argument("--precisions", help="comma-separated: 32, bf16-mixed")
    p.add_argument("--variants", help=f"comma-separated of {report.VARIANTS}")
    p.add_argument("--iterations", type=at_least(2), help="PPO iterations per run; the first is not counted")
    p.add_argument(
        "--rounds", type=at_least_one, help="runs of each variant per (config, precision) (2; --quick: 1)"
    )
    p.add_argument("--batch-size", type=at_least_one, help="rollout batch (64)")
    p.add_argument("--minibatches", type=at_least_one, help="minibatches per PPO epoch (4)")
    p.add_argument("--ppo-epochs", type=at_least_one, help="PPO epochs per iteration (4)")
    p.add_argument("--response-length", type=at_least_one, help="new tokens per response (32)")
    p.add_argument("--prompt-length", type=at_least_one, help="tokens per prompt of the main table (6)")
    p.add_argument(
        "--threads", type=at_least_one, help="torch threads per run (default: torch's; --quick: 1)"
    )
    p.add_argument("--main", action=argparse.BooleanOptionalAction, help="the main table (default: on)")
    p.add_argument("--scaling", action=argparse.BooleanOptionalAction, help="lightning_ppo scaling table")
    p.add_argument("--scaling-config", help="model preset of the scaling table")
    p.add_argument("--scaling-iterations", type=at_least(2), default=4, help="PPO iterations per scaling run")
    p.add_argument("--scaling-variants", default="lightning_ppo,floor", help="variants of the scaling table")
    p.add_argument("--scaling-lengths", default="32,64,128,256", help="response lengths of the scaling table")
    p.add_argument("--scaling-batches", default="16,64,128", help="rollout batches of the scaling table")
    p.add_argument("--variable", action=argparse.BooleanOptionalAction, help="the variable-length table")
    p.add_argument("--variable-config", help="model preset of the variable-length table")
    p.add_argument(
        "--variable-variants",
        help=f"comma-separated variants of the variable-length table (default: "
        f"{','.join(report.VARIABLE_VARIANTS)}; also trl, {report.COMPILED})",
    )
    p.add_argument("--variable-precision", help="precision of the variable-length table (32)")
    p.add_argument(
        "--variable-response", type=at_least_one, help="longest response of the variable workload (128)"
    )
    p.add_argument(
        "--variable-iterations", type=at_least(2), help="PPO iterations per variable-length run (4)"
    )
    p.add_argument(
        "--count-ops",
        action=argparse.BooleanOptionalAction,
        help="aten ops and host reads per iteration: one counting run per main-table point",
    )
    p.add_argument("--count-iterations", type=at_least_one, help="PPO iterations of a counting run (3)")
    p.add_argument("--no-phases", action="store_true", help="no per-phase timers (they synchronise on CUDA)")
    p.add_argument("--peak-tflops", type=positive, help="device peak for MFU where the device is not known")
    p.add_argument(
        "--wait-idle", type=seconds_or_zero, default=0, help="wait up to this many s for a quiet CPU per run"
    )
    p.add_argument(
        "--retry-busy", type=at_least(0), default=0, help="rerun a run up to N times if others used its cores"
    )
    p.add_argument("--timeout", type=seconds, default=1800, help="seconds allowed per run")
    p.add_argument(
        "--vllm-python",
        default=os.environ.get(VLLM_PYTHON_ENV) or str(DEFAULT_VLLM_PYTHON),
        help=f"interpreter of the lightning_ppo_vllm variant, one that can import vllm "
        f"(default: ${VLLM_PYTHON_ENV}, else {DEFAULT_VLLM_PYTHON.relative_to(ROOT)})",
    )
    p.add_argument("--out", default=str(ROOT / "runs" / "bench"), help="folder for the report, results, logs")
    p.add_argument(
        "--checkpoints",
        help="folder to keep the random checkpoints in, reused by a later run (default: temporary)",
    )
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    return args


def settings_for(args: argparse.Namespace, device: str) -> Settings:
    base = DEFAULTS["quick" if args.quick else device]
    given = {k: v for k, v in vars(args).items() if k in base.__dataclass_fields__ and v is not None}
    return replace(base, **given)


def kept_checkpoints(preset: str, folder: Path) -> tuple[Path, Path]:
    """``preset``'s random policy and reward model in ``folder``: built there unless a finished build
    is there (the reward's tokenizer is written last), e.g. by an earlier run with ``--checkpoints``."""
    policy, reward = folder / "policy", folder / "reward"
    if (reward / "tokenizer.json").exists() and (policy / "config.json").exists():
        return policy, reward
    return common.build_checkpoints(common.PRESETS[preset], folder)


def trl_available() -> bool:
    try:
        return importlib.util.find_spec("trl.experimental.ppo") is not None
    except ImportError:
        return False


# Asked of the vLLM interpreter: that vllm imports, and the head sizes of its CPU attention.
VLLM_PROBE = """
import json, vllm
try:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    sizes = sorted(CPUAttentionBackend.get_supported_head_sizes())
except Exception:
    sizes = None
print(json.dumps({"version": vllm.__version__, "cpu_head_sizes": sizes}))
"""


def probe_vllm(python: str) -> tuple[dict | None, str | None]:
    """(what the vLLM interpreter reports, None), or (None, why the vLLM variant cannot run)."""
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        return None, f"no interpreter at {python} (`make test-vllm` builds .venv-vllm; or --vllm-python)"
    try:
        proc = run([python, "-c", VLLM_PROBE], capture_output=True, text=True, timeout=300, check=False)
    except (OSError, TimeoutExpired) as err:
        return None, f"{python} could not be run: {err}"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"`import vllm` fails with {python}: {last[:200]}"
    return json.loads(lines[-1]), None


def vllm_preset_skips(info: dict, presets: list[str], device: str) -> dict[str, str]:
    """Model presets the vLLM variant cannot run here, with the reason: on CPU, a head size that
    vLLM's CPU attention has no kernel for (16: the tiny presets)."""
    sizes = info.get("cpu_head_sizes")
    if device != "cpu" or not sizes:
        return {}
    skips = {}
    for name in presets:
        preset = common.PRESETS[name]
        head = preset.n_embd // preset.n_head
        if head not in sizes:
            skips[name] = (
                f"{VLLM_VARIANT} skipped for {report.model_label(name)}: head size {head}, and vLLM "
                f"{info.get('version')}'s CPU attention has kernels for head sizes {sizes} only"
            )
    return skips


# ----------------------------------------------------------------------------- planning
def plan(
    args: argparse.Namespace,
    s: Settings,
    device: str,
    checkpoints: dict,
    skip: frozenset[tuple[str, str]] = frozenset(),
) -> list[report.Job]:
    """The main table's runs in rotating variant order, then the scaling runs (lightning_ppo only).
    ``skip``: (variant, preset) pairs not run."""

    def spec(variant: str, preset: str, precision: str) -> common.RunSpec:
        policy, reward = checkpoints[preset]
        return common.RunSpec(
            variant=variant,
            preset=preset,
            policy=str(policy),
            reward=str(reward),
            device=device,
            precision=precision,
            batch_size=s.batch_size,
            num_minibatches=s.minibatches,
            ppo_epochs=s.ppo_epochs,
            response_length=s.response_length,
            prompt_length=s.prompt_length,
            iterations=s.iterations,
            phases=not args.no_phases,
            threads=s.threads,
            engine=ENGINES.get(variant, "hf"),
            cache="dynamic" if variant == report.DYNAMIC else "static",
        )

    jobs, rotation = [], 0
    for preset in s.configs.split(",") if s.main else []:
        variants = [v for v in s.variants.split(",") if (v, preset) not in skip]
        if not variants:
            continue
        for precision in s.precisions.split(","):
            for _ in range(args.rounds):
                k = rotation % len(variants)
                rotation += 1
                jobs += [report.Job("main", spec(v, preset, precision)) for v in variants[k:] + variants[:k]]
    if s.count_ops:
        main = [job.spec for job in jobs]
        # One per point, not per round; not the compiled variant: torch.compile runs eagerly under
        # a TorchDispatchMode, so its count would be eager mode's (and its kernels are fused anyway).
        points = {report.point_key(spec): spec for spec in main if spec.variant != report.COMPILED}.values()
        jobs += [
            report.Job("count", replace(spec, count_ops=True, iterations=s.count_iterations, phases=False))
            for spec in points
        ]
    if s.scaling:
        points = [(s.batch_size, int(n)) for n in args.scaling_lengths.split(",")]
        points += [(int(b), s.response_length) for b in args.scaling_batches.split(",")]
        planned = {report.point_key(job.spec) for job in jobs}
        for batch, length in points:
            for variant in args.scaling_variants.split(","):
                if (variant, s.scaling_config) in skip or variant not in RUNNERS:
                    continue
                point = spec(variant, s.scaling_config, s.scaling_precision)
                point = replace(
                    point, batch_size=batch, response_length=length, iterations=args.scaling_iterations
                )
                # A point the main table runs anyway (its batch and length) is not run again.
                if report.point_key(point) not in planned:
                    planned.add(report.point_key(point))
                    jobs.append(report.Job("scaling", point))
    if s.variable:
        jobs += variable_jobs(args, s, spec, skip)
    return jobs


def variable_jobs(args, s: Settings, spec, skip) -> list[report.Job]:
    """The variable-length table's runs, in rotating order; the token budget is a quarter of a
    minibatch's padded rectangle (prompts up to 2 x and responses up to 1 x the response length)."""
    minibatch = s.batch_size // s.minibatches
    budget = minibatch * 3 * s.variable_response // 4
    variants = [v for v in s.variable_variants.split(",") if v and (v, s.variable_config) not in skip]
    jobs = []
    for k in range(args.rounds if variants else 0):
        for variant in variants[k % len(variants) :] + variants[: k % len(variants)]:
            point = replace(
                spec(variant, s.variable_config, s.variable_precision),
                workload="variable",
                response_length=s.variable_response,
                iterations=s.variable_iterations,
                micro_batch_tokens=budget if variant == "lightning_ppo_budget" else None,
            )
            jobs.append(report.Job("variable", point))
    return jobs


# ----------------------------------------------------------------------------- running
class CpuMeter:
    """Busy CPU core-seconds of the whole machine (Linux ``/proc/stat``), to tell how many cores other
    processes used while a run was going: busy time minus the run's own CPU time, over its wall time."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def busy_seconds(self) -> float | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return (user + nice + system + irq + softirq + steal) / self.tick

    @staticmethod
    def children_seconds() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    @staticmethod
    def spare_cores(threads: int) -> float:
        """How many cores other processes may keep busy without slowing a run of ``threads`` threads."""
        return max(0.25, (os.cpu_count() or 1) - threads + 0.25)

    def wait_for_idle(self, limit: float, threads: int) -> float:
        """Wait up to ``limit`` seconds until other processes leave ``threads`` cores free."""
        start = time.perf_counter()
        while time.perf_counter() - start < limit:
            before = self.busy_seconds()
            if before is None:
                break
            time.sleep(1.0)
            if self.busy_seconds() - before < self.spare_cores(threads):
                break
        return time.perf_counter() - start


def run_job(
    job: report.Job,
    index: int,
    work: Path,
    logs: Path,
    meter: CpuMeter,
    timeout: float,
    python: str = sys.executable,
) -> report.Done:
    """Run one variant in a subprocess of ``python``; a failure is recorded, not raised."""
    spec = job.spec
    name = (
        f"{index:02d}-{spec.variant}-{spec.preset}-{report.PRECISION_LABEL[spec.precision]}"
        f"-b{spec.batch_size}-r{spec.response_length}"
    )
    spec_path, result_path, log_path = (
        work / f"{name}.json",
        work / f"{name}.result.json",
        logs / f"{name}.log",
    )
    spec_path.write_text(json.dumps(asdict(spec)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if spec.engine == "vllm":
        # The engine runs in this process (the policy's weights are pushed to it by reference).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    command = [python, "-m", RUNNERS[spec.variant], str(spec_path), str(result_path)]
    busy, own, start = meter.busy_seconds(), meter.children_seconds(), time.perf_counter()
    with log_path.open("w") as log:
        try:
            proc = run(command, cwd=ROOT, env=env, stdout=log, stderr=log, timeout=timeout, check=False)
            failure = None if proc.returncode == 0 else f"exit code {proc.returncode}"
        except TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - start
    foreign = None
    if busy is not None:
        foreign = max(0.0, (meter.busy_seconds() - busy - (meter.children_seconds() - own)) / wall)
    if failure is None and result_path.exists():
        result = common.RunResult(**json.loads(result_path.read_text()))
    else:
        last = (log_path.read_text().strip().splitlines() or [""])[-1]
        result = common.RunResult(
            spec=asdict(spec), error=f"{failure or 'no result'}: {last[:200]} ({log_path})"
        )
    return report.Done(job, result, wall, foreign)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def resolve_device(choice: str) -> str | None:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        return None
    return choice


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device is None:
        print("CUDA is not available on this machine: skipping the GPU benchmark.")
        return 0
    s = settings_for(args, device)
    unknown = (set(s.variants.split(",")) - {*report.VARIANTS, report.DYNAMIC, report.COMPILED}) | (
        set(s.configs.split(",")) - set(common.PRESETS)
    )
    unknown |= set(filter(None, s.variable_variants.split(","))) - set(RUNNERS)
    if unknown:
        raise SystemExit(f"unknown variant or model preset: {sorted(unknown)}")
    notes = []
    if "trl" in f"{s.variants},{s.variable_variants}".split(",") and not trl_available():
        s.variants = ",".join(v for v in s.variants.split(",") if v != "trl")
        s.variable_variants = ",".join(v for v in s.variable_variants.split(",") if v != "trl")
        notes.append(
            "TRL is not importable (`make bench` installs the `bench` extra): its variant is skipped."
        )
        print(notes[-1])
        if not s.variants:
            return 0
    skip: set[tuple[str, str]] = set()
    if VLLM_VARIANT in s.variants.split(","):
        info, why = probe_vllm(args.vllm_python)
        if why is not None:
            s.variants = ",".join(v for v in s.variants.split(",") if v != VLLM_VARIANT)
            notes.append(f"{VLLM_VARIANT} is skipped: {why}.")
            print(notes[-1])
            if not s.variants:
                return 0
        else:
            notes.append(f"{VLLM_VARIANT}: vLLM {info['version']}, run with {args.vllm_python}")
            for preset, reason in vllm_preset_skips(info, s.configs.split(","), device).items():
                skip.add((VLLM_VARIANT, preset))
                notes.append(reason + ".")
                print(notes[-1])
    out, started, load_start = Path(args.out), time.strftime("%Y-%m-%d %H:%M %Z"), os.getloadavg()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lightning-ppo-bench-") as tmp:
        work = Path(tmp)
        presets = set(s.configs.split(",") if s.main else []) | ({s.scaling_config} if s.scaling else set())
        presets |= {s.variable_config} if s.variable else set()
        kept = Path(args.checkpoints) if args.checkpoints else work
        checkpoints = {p: kept_checkpoints(p, kept / p) for p in sorted(presets)}
        flops = report.Flops(checkpoints, args.peak_tflops)
        jobs = plan(args, s, device, checkpoints, frozenset(skip))
        print(f"{len(jobs)} runs on {device}; their logs go to {logs}", flush=True)
        dones, meter = [], CpuMeter()
        threads = s.threads or torch_threads()
        for i, job in enumerate(jobs, 1):
            for attempt in range(1 + args.retry_busy):
                if args.wait_idle and meter.wait_for_idle(args.wait_idle, threads) >= 2:
                    print("waited for other processes to free the cores", flush=True)
                python = args.vllm_python if job.spec.engine == "vllm" else sys.executable
                done = run_job(job, i, work, logs, meter, args.timeout, python)
                print(f"[{i}/{len(jobs)}] {report.describe(done)}", flush=True)
                busy = done.foreign_cores is not None and done.foreign_cores > meter.spare_cores(threads)
                if not busy or attempt == args.retry_busy:
                    break
                print("other processes needed the cores this run used: running it again", flush=True)
            dones.append(done)
            write_results(out, dones, flops)  # after every run: a stopped benchmark keeps what it ran
    load_end = os.getloadavg()
    facts = [
        f"started {started}; command: `{' '.join(['python -m benchmarks.bench', *argv])}`",
        f"load average (1, 5, 15 min) before: {report.triple(load_start)}; after: {report.triple(load_end)}",
        report.machine_line(dones, threads, device),
        f"per iteration: batch {s.batch_size}, {s.response_length} new tokens, {s.ppo_epochs} PPO epochs x "
        f"{s.minibatches} minibatches; {s.iterations} iterations per run ({args.scaling_iterations} per "
        f"scaling run) x {args.rounds} round(s); the first iteration of each run is not counted",
        *notes,
    ]
    text = report.render(dones, s, flops, facts)
    print("\n" + text)
    (out / "report.md").write_text(text)
    write_results(out, dones, flops)
    print(f"report written to {out / 'report.md'}")
    return 1 if any(d.result.error for d in dones if d.job.spec.variant != "trl") else 0


def write_results(out: Path, dones: list[report.Done], flops: report.Flops) -> None:
    """Every run's raw result, its wall time and MFU, as ``results.json``."""
    records = [
        {
            "group": d.job.group,
            "wall_s": d.wall_s,
            "foreign_cores": d.foreign_cores,
            "mfu": flops.mfu(report.merge([d]))[1],  # the whole iteration's, where the peak is known
            **asdict(d.result),
        }
        for d in dones
    ]
    (out / "results.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    sys.exit(main())
