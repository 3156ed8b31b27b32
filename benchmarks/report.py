"""Turning the runs' results into the report: medians, ratios, the phase breakdown, scaling and MFU.

Every figure is a median over the iterations of a point's runs, the first iteration of each run
left out (it pays for lazy initialisation and, on a GPU, kernel selection).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common

VARIANTS = ("lightning_ppo", "trl", "floor", "lightning_ppo_shared", "lightning_ppo_vllm")
# lightning_ppo with ``generation.cache_implementation: dynamic`` (HF's own cache, what it used
# before the static one): run only when named in --variants, and in the variable-length table.
DYNAMIC = "lightning_ppo_dynamic"
# lightning_ppo with ``ppo.torch_compile`` and ``generation.compile`` (loss passes and decoding steps under
# torch.compile): run only when named.
COMPILED = "lightning_ppo_compiled"
# The variable-length table's variants: the padded rectangle, the default (row groups, trimmed
# minibatches, a static generation cache), the default with HF's dynamic generation cache, a token
# budget for micro-batches, and the floor (padded, HF's dynamic cache).
VARIABLE_VARIANTS = (
    "lightning_ppo_padded",
    "lightning_ppo",
    DYNAMIC,
    "lightning_ppo_budget",
    "floor",
)
# The variable-length table's rows in order: its default variants, then those run only when named
# (``--variable-variants``): the compiled variant and TRL (its responses padded after the same lengths).
VARIABLE_ROWS = (*VARIABLE_VARIANTS, COMPILED, "trl")
# lightning_ppo with ``value_model: shared`` (one backbone for policy and critic): not the same
# work as the others, so it is compared with TRL's fp32 time only.
SHARED = "lightning_ppo_shared"
# lightning_ppo with ``generation.engine: vllm``: the same work as lightning_ppo, another sampler.
VLLM = "lightning_ppo_vllm"
PRECISION_LABEL = {"32": "fp32", "bf16-mixed": "bf16-mixed"}
# Phases in the order of an iteration; the floor has the first five, lightning_ppo all of them.
PHASES = (
    "generate",
    "weight_push",  # a part of generate: the engine's sync_weights
    "rollout_forwards",
    "reward",
    "experience",
    "train",
    "decode",
    "shape_scores",
    "stats",
    "log",
    "step_other",
    "lightning_loop",
)


@dataclass
class Job:
    """One subprocess run; ``group`` is the table it belongs to: ``main`` or ``scaling``."""

    group: str
    spec: common.RunSpec


@dataclass
class Done:
    job: Job
    result: common.RunResult
    wall_s: float
    foreign_cores: float | None  # mean CPU cores other processes kept busy during the run


def point_key(spec: common.RunSpec) -> tuple:
    """Runs with the same key are rounds of the same measurement."""
    return (spec.variant, spec.preset, spec.precision, spec.batch_size, spec.response_length)


@dataclass
class Row:
    """One point of a table: a variant at a model size, precision, batch and response length."""

    spec: common.RunSpec
    steady_s: list[float]  # seconds of every counted iteration
    gc_s: list[float]
    phases: list[dict[str, float]]
    peak_rss_mib: float
    peak_gpu_mib: float | None
    width: int  # generated tokens per sequence
    device_name: str
    error: str | None = None
    train_rss_mib: float | None = None  # the peak until training ended (RunResult.train_rss_mib)

    @property
    def seconds(self) -> float:
        return statistics.median(self.steady_s) if self.steady_s else float("nan")

    def phase(self, name: str) -> float | None:
        values = [p[name] for p in self.phases if name in p]
        return statistics.median(values) if values else None


def merge(dones: list[Done]) -> Row:
    """A point's runs (rounds) merged: all counted iterations, the highest peak memory."""
    spec = dones[0].job.spec
    ok = [d.result for d in dones if not d.result.error]
    if not ok:
        return Row(spec, [], [], [], 0.0, None, 0, "", error=dones[0].result.error)
    gpu = [r.peak_gpu_mib for r in ok if r.peak_gpu_mib is not None]
    return Row(
        spec=spec,
        steady_s=[s for r in ok for s in r.iteration_s[1:]],
        gc_s=[s for r in ok for s in r.gc_s[1:]],
        phases=[p for r in ok for p in r.phases[1:]],
        peak_rss_mib=max(r.peak_rss_mib for r in ok),
        train_rss_mib=max(r.train_rss_mib or r.peak_rss_mib for r in ok),
        peak_gpu_mib=max(gpu) if gpu else None,
        width=ok[-1].response_width or spec.response_length,
        device_name=ok[-1].device_name,
    )


def rows_by_point(dones: list[Done]) -> dict[tuple, Row]:
    groups: dict[tuple, list[Done]] = {}
    for done in dones:
        groups.setdefault(point_key(done.job.spec), []).append(done)
    return {key: merge(group) for key, group in groups.items()}


@dataclass(frozen=True)
class Counts:
    """A point's aten ops and host reads per iteration (benchmarks.op_count), from its counting run."""

    ops: float
    host_reads: float


def counts_by_point(dones: list[Done]) -> dict[tuple, Counts]:
    """The counting runs' per-iteration figures (the first iteration, lazy set-up, left out)."""
    from benchmarks.op_count import steady_per_iteration

    found = {}
    for done in dones:
        if not done.result.error and done.result.ops:
            counts = list(zip(done.result.ops, done.result.host_reads, strict=True))
            found[point_key(done.job.spec)] = Counts(*steady_per_iteration(counts))
    return found


# ----------------------------------------------------------------------------- FLOPs and MFU
class Flops:
    """Model FLOPs of a point's iteration, and its MFU where the device's peak is known."""

    def __init__(self, checkpoints: dict[str, tuple[Path, Path]], peak_override: float | None) -> None:
        from transformers import AutoTokenizer

        self.shapes = {preset: common.model_shape(policy) for preset, (policy, _) in checkpoints.items()}
        prompt = common.prompts(1)[0]
        self.prompt_len = {
            preset: len(AutoTokenizer.from_pretrained(policy)(prompt)["input_ids"])
            for preset, (policy, _) in checkpoints.items()
        }
        self.peak_override = peak_override

    def parts(self, row: Row) -> dict[str, float]:
        spec = row.spec
        return common.iteration_flops(
            self.shapes[spec.preset],
            spec.batch_size,
            self.prompt_len[spec.preset],
            row.width,
            spec.ppo_epochs,
            separate_critic=spec.variant != SHARED,
        )

    def total(self, row: Row) -> float:
        return sum(self.parts(row).values())

    def mfu(self, row: Row) -> tuple[float | None, float | None]:
        """(training passes, whole iteration) model FLOPs utilisation; None where unknown."""
        peak = self.peak_override or common.peak_tflops(row.device_name, row.spec.precision)
        if peak is None or row.error:
            return None, None
        train_s = row.phase("train")
        train = self.parts(row)["train"] / (train_s * peak * 1e12) if train_s else None
        return train, self.total(row) / (row.seconds * peak * 1e12)


# ----------------------------------------------------------------------------- formatting
def fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or value != value else f"{value:.{digits}f}"


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def triple(values: tuple[float, ...]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def model_label(preset: str) -> str:
    p = common.PRESETS[preset]
    return f"{preset} ({p.n_layer} x {p.n_embd})"


def describe(done: Done) -> str:
    """One progress line per run."""
    spec, result = done.job.spec, done.result
    what = (
        f"{spec.variant:20s} {spec.preset} {PRECISION_LABEL[spec.precision]:10s} "
        f"batch {spec.batch_size} x {spec.response_length} tokens"
    )
    if result.error:
        return f"{what}: FAILED {result.error}"
    if spec.count_ops:
        return f"{what}: aten ops per iteration {result.ops}, host reads {result.host_reads} (counted)"
    return (
        f"{what}: {result.median_s():.3f} s/it, peak RSS {result.peak_rss_mib:.0f} MiB "
        f"({done.wall_s:.0f} s; other processes: {fmt(done.foreign_cores, 2)} cores)"
    )


def machine_line(dones: list[Done], threads: int, device: str) -> str:
    """``threads``: the torch threads each run used."""
    name = next((d.result.device_name for d in dones if d.result.device_name), device)
    line = f"device: {name}" + (f" ({os.cpu_count()} CPU cores in the machine)" if device == "cpu" else "")
    loads = [d.foreign_cores for d in dones if d.foreign_cores is not None]
    if loads:
        line += (
            f"; other processes kept {statistics.mean(loads):.2f} cores busy on average during the runs "
            f"(most: {max(loads):.2f})"
        )
        if device == "cpu" and threads > 1 and max(loads) > 0.3:
            line += (
                "\n- WARNING: other processes competed for the CPU while runs used several threads; "
                "OpenMP threads then wait for each other and timings can be many times too slow. "
                "Rerun on a quiet machine, or with --threads 1."
            )
    return line


# ----------------------------------------------------------------------------- tables
def main_table(
    rows: dict[tuple, Row], s: Any, flops: Flops, gpu: bool, counts: dict[tuple, Counts] | None = None
) -> str:
    counts = counts or {}
    header = ["model", "precision", "variant", "s / iteration", "episodes / s", "gen. tokens / s"]
    header += ["peak RSS MiB", "training RSS MiB", "gc s / iteration", "aten ops / iteration"]
    header += ["host reads / iteration"]
    if gpu:
        header += ["peak GPU MiB", "train MFU", "iteration MFU"]
    body = []
    for preset in s.configs.split(","):
        for precision in s.precisions.split(","):
            for variant in s.variants.split(","):
                row = rows.get((variant, preset, precision, s.batch_size, s.response_length))
                if row is None:
                    continue
                cells = [model_label(preset), PRECISION_LABEL[precision], variant]
                if row.error:
                    body.append(cells + ["failed"] + ["n/a"] * (len(header) - 4))
                    continue
                cells += [
                    fmt(row.seconds),
                    fmt(row.spec.batch_size / row.seconds, 1),
                    fmt(row.spec.batch_size * row.width / row.seconds, 0),
                    fmt(row.peak_rss_mib, 0),
                    fmt(row.train_rss_mib, 0),
                    fmt(statistics.median(row.gc_s) if row.gc_s else None),
                ]
                count = counts.get(point_key(row.spec))
                cells += [f"{count.ops:,.0f}", f"{count.host_reads:.0f}"] if count else ["n/a", "n/a"]
                if gpu:
                    train_mfu, iteration_mfu = flops.mfu(row)
                    cells += [fmt(row.peak_gpu_mib, 0), pct(train_mfu), pct(iteration_mfu)]
                body.append(cells)
    return table(header, body)


def ratio(a: Row | None, b: Row | None) -> str:
    if a is None or b is None or a.error or b.error:
        return "n/a"
    return f"{a.seconds / b.seconds:.2f}"


def ops_ratio(counts: dict[tuple, Counts], a: tuple, b: tuple) -> str:
    if a not in counts or b not in counts:
        return "n/a"
    return f"{counts[a].ops / counts[b].ops:.2f}"


def rss_ratio(a: Row | None, b: Row | None) -> str:
    if a is None or b is None or a.error or b.error:
        return "n/a"
    return f"{a.train_rss_mib / b.train_rss_mib:.2f}"


def ratios_table(rows: dict[tuple, Row], s: Any, counts: dict[tuple, Counts] | None = None) -> str:
    counts = counts or {}
    body = []
    for preset in s.configs.split(","):
        trl_fp32 = rows.get(("trl", preset, "32", s.batch_size, s.response_length))
        for precision in s.precisions.split(","):

            def key(variant: str, preset: str = preset, precision: str = precision) -> tuple:
                return (variant, preset, precision, s.batch_size, s.response_length)

            lit, trl, floor, shared = (rows.get(key(v)) for v in ("lightning_ppo", "trl", "floor", SHARED))
            body.append(
                [
                    model_label(preset),
                    PRECISION_LABEL[precision],
                    ratio(lit, floor),
                    ratio(lit, trl),
                    ratio(trl, floor),
                    ratio(lit, trl_fp32),
                    ratio(shared, trl_fp32),
                    ops_ratio(counts, key("lightning_ppo"), key("floor")),
                    rss_ratio(lit, floor),
                ]
            )
    header = ["model", "precision", "lightning_ppo / floor", "lightning_ppo / TRL", "TRL / floor"]
    header += ["lightning_ppo / TRL fp32", "shared / TRL fp32", "aten ops: lightning_ppo / floor"]
    header += ["training RSS lightning_ppo / floor"]
    return table(header, body) + (
        "\n\nRatios of median seconds per iteration: below 1 is faster. `shared` is lightning_ppo "
        "with `value_model: shared` (one backbone for policy and critic: less work than the others). "
        "`aten ops`: the ratio of aten ops dispatched per iteration (each a kernel launch on a GPU). "
        "The last column compares the peak host RSS until training ended (the main table's "
        "training RSS: without what Lightning's teardown moves to the CPU after fit), not time."
    )


def phases_table(rows: dict[tuple, Row], s: Any) -> str:
    columns = [
        row
        for preset in s.configs.split(",")
        for precision in s.precisions.split(",")
        for variant in ("lightning_ppo", DYNAMIC, COMPILED, VLLM, "floor", SHARED)
        if (row := rows.get((variant, preset, precision, s.batch_size, s.response_length))) and row.phases
    ]
    if not columns:
        return "(no phase timings)"
    header = ["phase"] + [
        f"{r.spec.preset} {PRECISION_LABEL[r.spec.precision]} {r.spec.variant}" for r in columns
    ]
    body = [[name] + [fmt(r.phase(name)).replace("n/a", "-") for r in columns] for name in PHASES]
    body = [line for line in body if any(cell != "-" for cell in line[1:])]
    body.append(["iteration (median)"] + [fmt(r.seconds) for r in columns])
    return table(header, body) + (
        "\n\nMedian seconds per iteration in each phase. `generate`: sampling the rollout, the "
        "engine's weight push included (`weight_push`, a part of `generate`: nothing is copied for "
        "`hf`, the policy's weights are reloaded into the vLLM engine for `lightning_ppo_vllm`). "
        "`reward`: the reward-model forward (inside "
        "`score` for lightning_ppo); `rollout_forwards`: policy, reference and value forwards; "
        "`experience`: KL penalty, GAE, whitening; `train`: the PPO epochs (forward, backward, optimizer "
        "step). lightning_ppo only: `decode` (responses to text), `shape_scores`, `stats` and `log` "
        "(statistics and `self.log_dict`), `step_other` (the rest of `training_step`) and "
        "`lightning_loop` (the iteration's time outside `training_step`: batch fetch, hooks, loop)."
    )


def engines_table(rows: dict[tuple, Row], s: Any) -> str:
    """Generation time and the whole iteration of lightning_ppo with ``hf`` and with ``vllm``,
    beside TRL and the floor, at each (model, precision) of the main table."""
    body = []
    for preset in s.configs.split(","):
        for precision in s.precisions.split(","):
            found = {
                v: rows.get((v, preset, precision, s.batch_size, s.response_length))
                for v in ("lightning_ppo", VLLM, "trl", "floor")
            }
            hf = found["lightning_ppo"]
            for variant, row in found.items():
                if row is None:
                    continue
                engine = {"lightning_ppo": "hf", VLLM: "vllm", "trl": "TRL (HF generate)"}.get(
                    variant, "floor (HF generate)"
                )
                cells = [model_label(preset), PRECISION_LABEL[precision], variant, engine]
                if row.error:
                    body.append(cells + ["failed"] + ["n/a"] * 5)
                    continue
                gen, push = row.phase("generate"), row.phase("weight_push")
                ok_hf = hf is not None and not hf.error
                hf_gen = hf.phase("generate") if ok_hf else None
                cells += [
                    fmt(gen),
                    fmt(push).replace("n/a", "-"),
                    fmt(row.seconds),
                    pct(gen / row.seconds if gen is not None else None),
                    f"{gen / hf_gen:.2f}" if gen is not None and hf_gen else "n/a",
                    ratio(row, hf) if ok_hf else "n/a",
                ]
                body.append(cells)
    if not body:
        return ""
    header = ["model", "precision", "variant", "engine", "generate s", "of which weight push s"]
    header += ["s / iteration", "generate share", "generate / hf", "iteration / hf"]
    return table(header, body) + (
        "\n\nMedians over the counted iterations of the same alternated runs as the tables above. "
        "`generate s`: sampling the rollout batch, the engine's weight push included (for `vllm` the "
        "policy's weights reloaded into the engine before every rollout; the engine's start falls in "
        "the first, uncounted iteration); TRL's is its `batch_generation` (HF `generate`, keeping the "
        "logits); the floor's its HF `generate` call. `/ hf`: against lightning_ppo with `hf` (below 1 "
        "is faster)."
    )


def scaling_table(rows: dict[tuple, Row], dones: list[Done], s: Any, flops: Flops) -> str:
    """lightning_ppo along each axis (response length at the default batch, batch at the default
    length), time and work relative to the axis's first point; the floor beside it where it ran."""
    scaled = [d.job.spec for d in dones if d.job.group == "scaling"]
    if not scaled:
        return ""
    preset, precision = scaled[0].preset, scaled[0].precision

    def row(variant: str, batch: int, length: int) -> Row | None:
        found = rows.get((variant, preset, precision, batch, length))
        return found if found is not None and not found.error else None

    with_floor = any(spec.variant == "floor" for spec in scaled)
    lengths = sorted(
        {sp.response_length for sp in scaled if sp.batch_size == s.batch_size} | {s.response_length}
    )
    batches = sorted(
        {sp.batch_size for sp in scaled if sp.response_length == s.response_length} | {s.batch_size}
    )
    axes = {
        "response length": [(n, (s.batch_size, n)) for n in lengths],
        "rollout batch": [(b, (b, s.response_length)) for b in batches],
    }
    header = ["axis", "value", "s / iteration", "generate s", "train s"]
    header += ["floor s / iteration", "lightning_ppo / floor"] if with_floor else []
    header += ["time x", "gen. tokens x", "model FLOPs x", "peak RSS MiB", "ms / generated token"]
    body, verdicts = [], []
    for axis, values in axes.items():
        points = [(v, r, row("floor", *key)) for v, key in values if (r := row("lightning_ppo", *key))]
        if len(points) < 2:
            continue
        first, first_floor = points[0][1], points[0][2]
        for value, r, floor in points:
            tokens = r.spec.batch_size * r.width / (first.spec.batch_size * first.width)
            cells = [axis, str(value), fmt(r.seconds), fmt(r.phase("generate")), fmt(r.phase("train"))]
            if with_floor:
                cells += [fmt(floor.seconds) if floor else "n/a", ratio(r, floor)]
            cells += [
                f"{r.seconds / first.seconds:.2f}",
                f"{tokens:.2f}",
                f"{flops.total(r) / flops.total(first):.2f}",
                fmt(r.peak_rss_mib, 0),
                fmt(1000 * r.seconds / (r.spec.batch_size * r.width), 2),
            ]
            body.append(cells)
        value, last, last_floor = points[-1]
        time_x, work_x = last.seconds / first.seconds, flops.total(last) / flops.total(first)
        verdict = "no faster than the work" if time_x <= 1.1 * work_x else "faster than the work"
        line = (
            f"- {axis} {points[0][0]} -> {value}: time x{time_x:.2f} for x{work_x:.2f} model FLOPs "
            f"(peak RSS x{last.peak_rss_mib / first.peak_rss_mib:.2f}): cost grows {verdict}"
        )
        if first_floor and last_floor:
            line += f"; the floor's time x{last_floor.seconds / first_floor.seconds:.2f}"
        verdicts.append(line + ".")
    title = (
        f"{model_label(preset)}, {PRECISION_LABEL[precision]}; columns up to `train s` are lightning_ppo's"
    )
    return f"{title}\n\n" + table(header, body) + "\n\n" + "\n".join(verdicts)


def variable_table(dones: list[Done]) -> str:
    """The variable-length workload: seconds per iteration and the policy tokens computed."""
    rows = rows_by_point(dones)
    by_variant = {key[0]: row for key, row in rows.items()}
    bases = [by_variant.get(name) for name in ("lightning_ppo_padded", "floor", "trl")]
    body = []
    for variant in VARIABLE_ROWS:
        row = by_variant.get(variant)
        if row is None:
            continue
        runs = [d.result for d in dones if d.job.spec.variant == variant and not d.result.error]
        iterations = sum(len(r.iteration_s) for r in runs) or 1
        computed = sum(r.tokens_computed for r in runs) / iterations
        real = sum(r.tokens_real for r in runs) / iterations
        ratios = [fmt(row.seconds / b.seconds, 2) if b and not b.error else "n/a" for b in bases]
        tokens = [f"{computed:,.0f}", f"{real:,.0f} ({real / computed:.0%})" if computed else "n/a"]
        body.append([variant, fmt(row.seconds), *ratios, *tokens])
    header = ["variant", "s / iteration", "vs padded", "vs floor", "vs TRL", "policy tokens computed / it"]
    return table([*header, "real"], body)


COUNTS_NOTE = (
    "`aten ops / iteration` and `host reads / iteration`: counted in a separate, untimed run of each "
    "point (`benchmarks.op_count`, a `TorchDispatchMode`), its first iteration left out. Every aten "
    "op is a kernel launch the host dispatches on a GPU, the CPU proxy of its dispatch time; a host "
    "read (`.item()`, `float()`/`bool()` of a tensor, `.tolist()`, `.numpy()`, a copy to the CPU) waits "
    "for all queued work. On CPU every `.tolist()`/`.numpy()` counts, also of tensors that would stay "
    "on the host on a GPU. `lightning_ppo_compiled` is not counted: under a dispatch mode "
    "torch.compile runs eagerly."
)


def render(dones: list[Done], s: Any, flops: Flops, facts: list[str]) -> str:
    variable = [d for d in dones if d.job.group == "variable"]
    counted = [d for d in dones if d.job.group == "count"]
    dones = [d for d in dones if d.job.group not in ("variable", "count")]
    rows, counts = rows_by_point(dones), counts_by_point(counted)
    gpu = any(r.peak_gpu_mib is not None for r in rows.values()) or flops.peak_override is not None
    parts = ["# lightning_ppo benchmark", "\n".join(f"- {fact}" for fact in facts)]
    parts += ["## Seconds per PPO iteration", main_table(rows, s, flops, gpu, counts)]
    if counts:
        parts += [COUNTS_NOTE]
    if len(s.variants.split(",")) > 1:
        parts += ["## Ratios", ratios_table(rows, s, counts)]
    parts += ["## Where the time goes", phases_table(rows, s)]
    if VLLM in s.variants.split(","):
        engines = engines_table(rows, s)
        if engines:
            parts += ["## Generation engines: hf vs vllm", engines]
    scaling = scaling_table(rows, dones, s, flops)
    if scaling:
        parts += ["## Scaling", scaling]
    if variable:
        spec = variable[0].job.spec
        parts += [
            "## Variable-length sequences",
            f"{model_label(spec.preset)}, {PRECISION_LABEL[spec.precision]}, batch {spec.batch_size}: "
            f"prompts of 8 to {2 * spec.response_length} tokens, responses cut at 1 to "
            f"{spec.response_length} tokens (the same lengths in every variant); policy tokens: its "
            "rollout forward and every PPO pass, rows x columns computed, and the real ones among them "
            "(TRL: its PPO passes; its rollout log-probs come from generation's logits).",
            variable_table(variable),
        ]
    failed = [f"- {describe(d)}" for d in dones + variable + counted if d.result.error]
    if failed:
        parts += ["## Failed runs", "\n".join(failed)]
    return "\n\n".join(parts) + "\n"
