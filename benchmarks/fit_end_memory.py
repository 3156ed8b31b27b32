"""Peak host memory of a whole run, read from outside the process, against the floor's (issue 43).

    .venv/bin/python -m benchmarks.fit_end_memory            # CPU: a 6 x 512 GPT-2 (35M parameters)
    .venv/bin/python -m benchmarks.fit_end_memory --device cuda --preset llama-0.5b --precision bf16-mixed

Each variant runs in its own process, the same PPO iterations ``benchmarks.bench`` runs (its
runners): ``floor`` (bare PyTorch, ``benchmarks.floor``), ``lightning_ppo`` (the real Trainer,
``benchmarks.run_lightning``) and ``lightning_teardown`` (the same with Lightning's own
``Strategy.teardown``: ``models.placement.keep_through_teardown`` patched out, so the end of ``fit``
moves every role and AdamW's moments to the host, as before issue 43). The peak is the child's
``ru_maxrss`` as ``os.wait4`` returns it when it has exited: the whole process, its teardown and
exit included. A child's ``ru_maxrss`` starts at its parent's resident size when it was started
(Linux carries it over the exec), so this driver imports neither torch nor transformers (its own
size is printed; the checkpoints are written by a child). The runner's own readings of VmHWM are
printed beside it: at the end of training (before teardown) and at the end of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks import common
from benchmarks.flags import at_least, at_least_one

ROOT = Path(__file__).resolve().parents[1]
# GPT-2 with 6 layers of 512 and a 32k vocabulary (tied head): ~35M parameters, 140 MB in fp32
PRESETS = {"gpt2-35m": common.ModelPreset("gpt2-35m", "gpt2", 6, 512, 8, extra_vocab=32000)}
RUNNERS = {
    "floor": "benchmarks.floor",
    "lightning_ppo": "benchmarks.run_lightning",
    "lightning_teardown": "benchmarks.fit_end_memory",
}


def preset(name: str) -> common.ModelPreset:
    return PRESETS.get(name) or common.PRESETS[name]


def build(name: str, out: str) -> None:
    """Child: write the preset's policy and reward checkpoints under ``out``."""
    common.build_checkpoints(preset(name), Path(out))


def lightning_teardown(spec_path: str, result_path: str) -> None:
    """Child: ``run_lightning`` with Lightning's own teardown (the roles and the state moved to the host)."""
    import lightning_ppo.module
    from benchmarks import run_lightning

    lightning_ppo.module.keep_through_teardown = lambda strategy: None
    spec = common.RunSpec(**json.loads(Path(spec_path).read_text()))
    Path(result_path).write_text(json.dumps(asdict(run_lightning.run(spec))))


def run_variant(spec: common.RunSpec, tmp: Path) -> dict[str, float]:
    """One run of ``spec.variant`` in its own process: the peak RSS ``os.wait4`` reports, and its own."""
    spec_path, result_path = tmp / f"{spec.variant}.spec.json", tmp / f"{spec.variant}.result.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    module = RUNNERS[spec.variant]
    args = ["--child-teardown"] if spec.variant == "lightning_teardown" else []
    log = (tmp / f"{spec.variant}.log").open("w")
    cmd = [sys.executable, "-m", module, *args, str(spec_path), str(result_path)]
    child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{spec.variant} failed: {(tmp / f'{spec.variant}.log').read_text()[-3000:]}")
    result = json.loads(result_path.read_text())
    return {
        "outside_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "train_mib": result["train_rss_mib"] or result["peak_rss_mib"],
        "inside_mib": result["peak_rss_mib"],
        "gpu_mib": result.get("peak_gpu_mib") or 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="gpt2-35m", help=f"{list(PRESETS)} or benchmarks.common's")
    parser.add_argument("--precision", default="32")
    parser.add_argument("--batch-size", type=at_least_one, default=16)
    parser.add_argument("--response-length", type=at_least_one, default=16)
    parser.add_argument("--iterations", type=at_least_one, default=3)
    parser.add_argument("--rounds", type=at_least_one, default=1, help="alternating rounds; medians reported")
    parser.add_argument("--variants", default=",".join(RUNNERS))
    parser.add_argument("--threads", type=at_least(0), default=0)
    parser.add_argument("--json", help="also write the table's rows to this file")
    parser.add_argument("--child-build", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--child-teardown", nargs=2, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child_build:
        return build(*ns.child_build)
    if ns.child_teardown:
        return lightning_teardown(*ns.child_teardown)
    variants = ns.variants.split(",")
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as out:
        tmp = Path(out)
        build_cmd = [sys.executable, "-m", "benchmarks.fit_end_memory", "--child-build", ns.preset, out]
        subprocess.run(build_cmd, cwd=ROOT, check=True, capture_output=True)
        driver_mib = common.peak_rss_mib()
        for round_ in range(ns.rounds):
            for variant in variants[round_ % len(variants) :] + variants[: round_ % len(variants)]:
                spec = common.RunSpec(
                    variant=variant,
                    preset=ns.preset,
                    policy=str(tmp / "policy"),
                    reward=str(tmp / "reward"),
                    device=ns.device,
                    precision=ns.precision,
                    batch_size=ns.batch_size,
                    num_minibatches=2,
                    ppo_epochs=1,
                    response_length=ns.response_length,
                    iterations=ns.iterations,
                    phases=False,
                    threads=ns.threads,
                )
                rows[variant].append(run_variant(spec, tmp))
    p = preset(ns.preset)
    print(
        f"{ns.preset} ({p.n_layer} x {p.n_embd}), {ns.device}, precision {ns.precision}, batch "
        f"{ns.batch_size} x {ns.response_length} new tokens, {ns.iterations} iterations, medians of "
        f"{ns.rounds} round(s); the driver's own peak RSS {driver_mib:.0f} MiB"
    )
    table = medians(rows, ns)
    print(
        "| variant | peak RSS, from outside (MiB) | x floor | training peak, its own (MiB) "
        "| run's peak, its own (MiB) | peak GPU (MiB) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for row in table:
        ratio = f"{row['x_floor']:.2f}" if row["x_floor"] is not None else ""
        print(
            f"| {row['variant']} | {row['outside_mib']:.0f} | {ratio} | {row['train_mib']:.0f} "
            f"| {row['inside_mib']:.0f} | {row['gpu_mib']:.0f} |"
        )
    if ns.json:
        Path(ns.json).write_text(json.dumps(table, indent=1))


def medians(rows: dict[str, list[dict[str, float]]], ns: argparse.Namespace) -> list[dict]:
    """One row per variant: the medians of its rounds, its shape and its peak against the floor's."""
    floor = statistics.median(r["outside_mib"] for r in rows["floor"]) if "floor" in rows else None
    shape = {"preset": ns.preset, "precision": ns.precision}
    shape |= {"batch_size": ns.batch_size, "response_length": ns.response_length}
    table = []
    for variant, runs in rows.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        x_floor = med["outside_mib"] / floor if floor else None
        table.append({"variant": variant, **shape, **med, "x_floor": x_floor})
    return table


if __name__ == "__main__":
    main()
