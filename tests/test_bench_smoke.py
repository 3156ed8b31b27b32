"""The benchmark runs end to end on a tiny model (lightning_ppo, shared-critic too, and the floor).

Nothing here asserts on speed: only that every run finished and the report holds positive numbers.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import bench
from benchmarks import report as report_module
from tests.helpers import forked_run


def _table_rows(report: str, first_cell: str) -> list[list[str]]:
    rows = [line.strip("|").split("|") for line in report.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row] for row in rows if row[0].strip().startswith(first_cell)]


@pytest.mark.long  # the benchmark end to end: 9 runs of a tiny model (63 s in a loaded make test)
def test_quick_benchmark_reports_positive_numbers(tmp_path, capsys, monkeypatch):
    # each run a process of its own as the benchmark starts it, forked from one that has done the imports
    monkeypatch.setattr(bench, "run", forked_run)
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    report = (tmp_path / "report.md").read_text()
    assert report in printed

    records = json.loads((tmp_path / "results.json").read_text())
    results = [r for r in records if r["group"] == "main"]
    assert sorted(r["spec"]["variant"] for r in results) == ["floor", "lightning_ppo", "lightning_ppo_shared"]
    for result in results:
        assert result["error"] is None
        assert len(result["iteration_s"]) == 2 and all(s > 0 for s in result["iteration_s"])
        assert result["peak_rss_mib"] > 0 and result["response_width"] == 8

    # one untimed counting run per main-table point: aten ops and host reads of its second iteration
    counted = [r for r in records if r["group"] == "count"]
    assert sorted(r["spec"]["variant"] for r in counted) == ["floor", "lightning_ppo", "lightning_ppo_shared"]
    assert all(len(r["ops"]) == 2 and r["ops"][1] > 0 and r["host_reads"][1] > 0 for r in counted)

    rows = _table_rows(report, "tiny")
    names = {"lightning_ppo", "floor", "lightning_ppo_shared"}
    main = [row for row in rows if len(row) == 11 and row[2] in names]
    assert {row[2] for row in main} == names
    for row in main:
        seconds, episodes, tokens, rss, train_rss = (float(cell) for cell in row[3:8])
        assert min(seconds, episodes, tokens, rss, train_rss) > 0 and train_rss <= rss
        ops, reads = float(row[9].replace(",", "")), float(row[10])
        assert ops > 0 and reads > 0
    ratios = [row for row in rows if len(row) == 9][0]
    assert float(ratios[2]) > 0  # lightning_ppo / floor
    assert ratios[6] == "n/a"  # shared / TRL fp32: the quick run has no TRL
    assert float(ratios[7]) > 0  # aten ops: lightning_ppo / floor
    assert float(ratios[8]) > 0  # peak RSS lightning_ppo / floor

    # the variable-length workload: the same scheduled lengths in every variant, padding left out
    variable = {r["spec"]["variant"]: r for r in records if r["group"] == "variable"}
    assert sorted(variable) == sorted(report_module.VARIABLE_VARIANTS)
    real = {r["tokens_real"] for r in variable.values()}
    assert len(real) == 1 and real.pop() > 0  # the same work everywhere
    computed = {name: r["tokens_computed"] for name, r in variable.items()}
    assert computed["lightning_ppo_padded"] == computed["floor"]
    assert computed["lightning_ppo_budget"] <= computed["lightning_ppo"] < computed["lightning_ppo_padded"]
    assert computed["lightning_ppo_dynamic"] == computed["lightning_ppo"]  # only generation's cache differs
    assert len(_table_rows(report, "lightning_ppo_budget")) == 1

    train = [line for line in report.splitlines() if line.startswith("| train |")]
    assert train and all(float(x) >= 0 for x in re.findall(r"\d+\.\d+", train[0]))


def test_trl_is_skipped_cleanly_when_not_importable(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "trl_available", lambda: False)
    assert bench.main(["--quick", "--variants", "trl", "--out", str(tmp_path)]) == 0
    assert "TRL is not importable" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on machines without CUDA")
def test_gpu_benchmark_skips_without_cuda(tmp_path, capsys):
    assert bench.main(["--device", "cuda", "--out", str(tmp_path)]) == 0
    assert "CUDA is not available" in capsys.readouterr().out


def test_gpu_check_counts_generated_tokens_per_second_of_the_steady_iterations():
    from benchmarks.gpu_check import generated_per_s

    result = {
        "spec": {"batch_size": 64},
        "response_width": 256,
        "phases": [{"generate": 9.0}, {"generate": 2.0}, {"generate": 4.0}, {"train": 1.0}],
    }
    assert generated_per_s(result) == 64 * 256 / 3.0  # the first (warm-up) left out, then the median
    assert generated_per_s({**result, "phases": []}) is None


@pytest.mark.long  # 8 s, 50 s with inductor's cache cold
def test_gpu_check_variable_stage_runs_its_cpu_trial(tmp_path, monkeypatch):
    # gpu_check's `bench-64x32-variable` on the CPU: its benchmark in this process (its runs forked,
    # as above), to check the stage's flags and rows, not its speed
    from benchmarks import gpu_check

    def in_process(command, log, timeout, **env):
        assert command[1:3] == ["-m", "benchmarks.bench"]
        with log.open("w") as out, contextlib.redirect_stdout(out):
            code = bench.main(command[3:])
        return None if code == 0 else f"exit {code}"

    monkeypatch.setattr(bench, "run", forked_run)
    monkeypatch.setattr(gpu_check, "run_logged", in_process)
    stage = "bench-64x32-variable"
    argv = ["--accelerator", "cpu", "--stages", stage, "--out", str(tmp_path), "--budget", "900"]
    assert gpu_check.main(argv) == 0

    rows = {line["what"].split()[0]: line for line in json.loads((tmp_path / "gpu-check.json").read_text())}
    assert sorted(rows) == sorted(gpu_check.VARIABLE_VARIANTS)
    ran = [name for name in rows if name != "trl" or bench.trl_available()]
    for name in ran:
        row = rows[name]
        assert row["stage"] == stage and row["status"] == "ok" and row["precision"] == "bf16-mixed"
        assert "tiny-llama b8 x 1-8, prompts 8-16" in row["what"] and row["s_per_it"] > 0
        assert "policy tokens real" in row["note"]
        assert ("x TRL" in row["note"]) == ("trl" in ran and name != "trl")
    if "trl" not in ran:
        assert rows["trl"]["status"] == "skipped" and "not importable" in rows["trl"]["note"]

    # the same scheduled lengths in every variant: the same real tokens per policy pass
    records = json.loads((tmp_path / stage / "results.json").read_text())
    passes = {r["spec"]["variant"]: 2 if r["spec"]["variant"] == "trl" else 3 for r in records}  # 2 epochs
    real = {r["tokens_real"] // passes[r["spec"]["variant"]] for r in records}
    assert len(real) == 1 and real.pop() > 0
    assert "| lightning_ppo_compiled |" in (tmp_path / stage / "report.md").read_text()


def test_gpu_check_kills_a_timed_out_command_with_its_children(tmp_path):
    from benchmarks import gpu_check

    # the command starts a child (as the benchmark starts its runs), prints its pid and waits
    sleep = "[sys.executable, '-c', 'import time; time.sleep(60)']"
    script = f"import subprocess, sys, time; p = subprocess.Popen({sleep}); print(p.pid, flush=True)"
    script += "; time.sleep(60)"
    command = [sys.executable, "-c", script]
    log = tmp_path / "log"
    assert gpu_check.run_logged(command, log, timeout=3) == "timed out after 3 s"
    pid = int(log.read_text().split()[0])
    for _ in range(50):  # reaped by init once its parent is gone
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the command's child {pid} outlived its timeout")


def test_gpu_check_sets_each_row_against_the_floor_and_trl():
    from benchmarks.gpu_check import Line, against

    def record(variant: str, generate: list[float]) -> dict:
        return {"spec": {"variant": variant}, "phases": [{"generate": s} for s in generate]}

    records = [record("lightning_ppo_compiled", [9.0, 2.0]), record("floor", [9.0, 5.0]), record("trl", [])]
    seconds = zip(records, [3, 4, 6], strict=True)
    lines = [Line("s", r["spec"]["variant"], "", "ok", s, note="n") for r, s in seconds]
    against(lines, records, "trl")
    against(lines, records, "floor")
    # the first (warm-up) iteration's generation left out: 2 s against the floor's 5 s
    assert lines[0].note == "0.75x floor (generation 0.40x), 0.50x TRL, n"
    assert lines[1].note == "0.67x TRL, n"
    assert lines[2].note == "n"  # TRL's own row is set against nothing


@pytest.mark.long
def test_gpu_check_fit_end_stage_runs_its_cpu_trial(tmp_path):
    # the stage's command and rows on the CPU (its runs real processes, read from outside), not its figures
    from benchmarks import gpu_check

    argv = ["--accelerator", "cpu", "--stages", "fit-end", "--out", str(tmp_path), "--budget", "600"]
    assert gpu_check.main(argv) == 0
    rows = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [row["what"] for row in rows] == ["floor tiny-llama b8 x 8", "lightning_ppo tiny-llama b8 x 8"]
    for row in rows:
        assert row["status"] == "ok" and row["rss_mib"] > 100
        assert re.match(r"\d\.\d\dx the floor's peak RSS", row["note"])
    assert rows[0]["note"].startswith("1.00x")


@pytest.mark.selfcheck
def test_gpu_check_selfcheck_stage_runs_its_cpu_trial(tmp_path):
    # the stage's command and row on the CPU, bf16-mixed as on the GPU (the selfcheck a real process)
    from benchmarks import gpu_check

    argv = ["--accelerator", "cpu", "--stages", "selfcheck", "--out", str(tmp_path), "--budget", "600"]
    assert gpu_check.main(argv) == 0  # a FAIL would be a FAILED row and exit status 1
    rows = json.loads((tmp_path / "gpu-check.json").read_text())
    (row,) = rows
    assert (row["stage"], row["precision"], row["status"]) == ("selfcheck", "bf16-mixed", "ok")
    assert row["what"].startswith("cpu x 1, SingleDevice, bf16-mixed, engine hf, gae")
    objective = json.loads((tmp_path / "selfcheck" / "selfcheck.json").read_text())["objective"]
    assert objective["low"] <= objective["gap"] <= objective["high"]
