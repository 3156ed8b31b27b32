"""The benchmarks' numeric flags: a count or a time a benchmark cannot use is argparse's usage error
(exit 2, its error line naming the flag) before anything runs. ``sync_transports --repeats 0`` ran
its first sync and then failed on the median of no repeats: a FAILED row (exit 1), or, without a
GPU, a skipped run that exit 0; other counts of 0 ran empty loops, divided by zero or hung."""

from __future__ import annotations

import importlib
import sys

import pytest

# (module, flag, a value it refuses): every numeric flag that counts or times something
REFUSED = [
    ("async_rollouts", "--iterations", "0"), ("async_rollouts", "--rounds", "0"),
    ("bench", "--iterations", "1"), ("bench", "--rounds", "0"), ("bench", "--batch-size", "0"),
    ("bench", "--minibatches", "0"), ("bench", "--ppo-epochs", "-1"), ("bench", "--response-length", "0"),
    ("bench", "--prompt-length", "0"), ("bench", "--threads", "0"), ("bench", "--scaling-iterations", "1"),
    ("bench", "--variable-response", "0"), ("bench", "--variable-iterations", "0"),
    ("bench", "--count-iterations", "0"), ("bench", "--peak-tflops", "0"), ("bench", "--wait-idle", "-1"),
    ("bench", "--retry-busy", "-1"), ("bench", "--timeout", "0"),
    ("compile_count", "--iterations", "0"),
    ("decoding", "--batch", "0"), ("decoding", "--threads", "-1"), ("decoding", "--profile", "-1"),
    ("decoding", "--budget", "-1"),
    ("diversity", "--answers", "0"), ("diversity", "--chars", "0"),
    ("env_copies", "--batch", "0"), ("env_copies", "--rounds", "0"),
    ("episodes", "--rounds", "0"), ("episodes", "--iterations", "0"),
    ("fake_servers", "--tokens", "0"),
    ("fit_end_memory", "--batch-size", "0"), ("fit_end_memory", "--response-length", "0"),
    ("fit_end_memory", "--iterations", "0"), ("fit_end_memory", "--rounds", "0"),
    ("fit_end_memory", "--threads", "-1"),
    ("fsdp2_speed", "--iterations", "0"), ("fsdp2_speed", "--rounds", "0"),
    ("gpu_check", "--budget", "0"), ("gpu_check", "--quickstart-iterations", "0"),
    ("gpu_check", "--config-iterations", "0"),
    ("learning", "--iterations", "0"), ("learning", "--kl-horizon", "0"), ("learning", "--warm-steps", "-1"),
    ("learning", "--only", "0"),
    ("reward_scale", "--iterations", "0"), ("reward_scale", "--kl-horizon", "0"),
    ("selfcheck_calibration", "--lr", "0"), ("selfcheck_calibration", "--iterations", "0"),
    ("servers", "--iterations", "0"), ("servers", "--rounds", "0"),
    ("sharded_memory", "--iterations", "1"),
    ("sync_transports", "--repeats", "0"), ("sync_transports", "--repeats", "-3"),
]  # fmt: skip


@pytest.mark.parametrize(("module", "flag", "value"), REFUSED)
def test_a_count_or_time_a_benchmark_cannot_use_is_a_usage_error_naming_the_flag(
    module, flag, value, monkeypatch, capsys
):
    bench = importlib.import_module(f"benchmarks.{module}")
    monkeypatch.setattr(sys, "argv", [module, flag, value])  # the mains that read sys.argv
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert f": error: argument {flag}: must be " in said and said.endswith(f", got {value}")


def test_sync_transports_repeats_0_is_a_usage_error(capsys):
    from benchmarks import sync_transports

    with pytest.raises(SystemExit) as exited:
        sync_transports.main(["--repeats", "0"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m benchmarks.sync_transports: error: argument --repeats: must be at least 1, got 0"
    )
