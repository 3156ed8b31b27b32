"""`lightning-ppo plot` draws a PNG from a real run's CSV log; bad folders get clear errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.image
import pytest

from lightning_ppo.cli import main
from lightning_ppo.watch.plot import (
    FRONTIER,
    find_metrics_csv,
    frontier,
    panel_keys,
    plot_run,
    read_metrics,
    run_name,
)

ROOT = Path(__file__).resolve().parents[1]


def test_plot_command_draws_a_png_from_a_real_run(tiny_digits, tmp_path):
    logger = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path / "run")},
    }
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--model.init_args.policy",
            str(tiny_digits),
            "--trainer.limit_train_batches",
            "3",
            "--trainer.logger",
            json.dumps([logger]),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.callbacks",
            "[]",
            "--data.init_args.batch_size",
            "8",
            "--trainer.val_check_interval",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--data.init_args.num_val_prompts",
            "8",
        ]
    )
    csv_path = find_metrics_csv(tmp_path / "run")
    _, series = read_metrics(csv_path)
    # eval rows carry the iteration too: one x-axis for training and evaluation
    rows = list(csv.DictReader(csv_path.open()))
    assert [row["iteration"] for row in rows if row["eval/scores"]] == ["2.0"]
    assert panel_keys(series)[:4] == ["objective/scores", "eval/scores", "objective/kl", FRONTIER]
    assert "kl_coef" not in panel_keys(series)  # fixed coefficient: a flat line, not drawn by default
    assert run_name(tmp_path / "run", csv_path) == run_name(csv_path, csv_path) == "run"
    out = tmp_path / "curves.png"
    main(["plot", str(tmp_path / "run"), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 300 and image.shape[1] > 600
    assert image.std() > 0.05  # not a blank canvas


def test_plot_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="run folder not found"):
        plot_run(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no metrics.csv found under"):
        plot_run(tmp_path)
    (tmp_path / "metrics.csv").write_text("step,other\n0,1.0\n")
    with pytest.raises(ValueError, match="available columns: \\['other'\\]"):
        plot_run(tmp_path)


def test_plot_command_reports_a_bad_folder_without_a_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"no metrics.csv found under {tmp_path}" in capsys.readouterr().err


def test_the_frontier_pairs_smoothed_score_and_kl_by_iteration_and_kl_coef_shows_when_it_moves():
    series = {
        "objective/kl": ([1.0, 2.0, 3.0, 4.0], [0.0, 2.0, 4.0, 6.0]),
        "objective/scores": ([1.0, 2.0, 4.0], [0.1, 0.3, 0.9]),  # step 3 logged no score
        "kl_coef": ([1.0, 2.0, 3.0, 4.0], [0.05, 0.06, 0.07, 0.08]),
    }
    kl, score, steps = frontier(series, window=2)
    assert steps == [1.0, 2.0, 4.0]
    assert kl == pytest.approx([0.0, 1.0, 4.0])  # trailing means of KL 0, 2, 6
    assert score == pytest.approx([0.1, 0.2, 0.6])
    assert panel_keys(series) == ["objective/scores", "objective/kl", FRONTIER, "kl_coef"]
