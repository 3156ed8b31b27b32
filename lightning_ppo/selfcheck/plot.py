"""The selfcheck's picture: the run's curves against the exact optimum and its band.

Four panels: ``objective/scores``, ``objective/kl`` and the objective ``scores - beta kl`` over the
iterations with the optimum's value and its band over the plateau (and the reference's and the
greedy answer's reward); and the run's path in the (KL, reward) plane beside the exact frontier, the
optimum of every beta, which a correct run approaches at the point of its own beta. Drawn on the
Agg canvas, as ``lightning-ppo plot`` draws.
"""

from __future__ import annotations

from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lightning_ppo.selfcheck.exact import TiltedOptimum
from lightning_ppo.selfcheck.optimum import ListedEpisodes, ListedTask
from lightning_ppo.selfcheck.verdict import KL, SCORES, Check
from lightning_ppo.watch.plot import moving_average, read_metrics


def plot_selfcheck(
    metrics: Path,
    listed: ListedTask | ListedEpisodes,
    optimum: TiltedOptimum,
    checks: tuple[Check, Check, Check],
    window: int,
    out: Path,
) -> Path:
    """Draw the selfcheck of the run logged in ``metrics`` to the PNG ``out``."""
    _, series = read_metrics(metrics)
    fig = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).flatten()
    scores_steps, scores = series[SCORES]
    kl_at = dict(zip(*series[KL], strict=True))
    objective = [s - optimum.beta * kl_at[step] for step, s in zip(scores_steps, scores, strict=True)]
    curves = (series[SCORES], series[KL], (scores_steps, objective))
    for ax, check, (steps, values) in zip(axes[:3], checks, curves, strict=True):
        _draw_against(ax, steps, values, check, window)
    axes[0].axhline(optimum.reference_reward, color="0.5", linestyle=":", label="reference")
    axes[0].axhline(optimum.greedy_reward, color="tab:red", linestyle=":", label="greedy")
    axes[0].legend(fontsize=7, loc="lower right")
    _draw_frontier(axes[3], series, listed, optimum)
    verdict = "PASS" if all(c.passed for c in checks) else "FAIL"
    fig.suptitle(f"selfcheck {verdict}: beta {optimum.beta:g} ({metrics})", fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def _draw_against(ax, steps: list[float], values: list[float], check: Check, window: int) -> None:
    ax.plot(steps, values, color="tab:blue", alpha=0.35, linewidth=1.0)
    ax.plot(steps, moving_average(values, max(1, window // 4)), color="tab:blue", linewidth=1.6, label="run")
    ax.axhline(check.exact, color="black", linewidth=1.2, label="exact optimum")
    start = steps[-window] if len(steps) >= window else steps[0]
    ax.fill_between(
        [start, steps[-1]], check.exact + check.low, check.exact + check.high, color="tab:green", alpha=0.25
    )
    ax.hlines(check.reached, start, steps[-1], color="tab:orange", linewidth=2.0, label="plateau mean")
    ax.set_title(f"{check.name}: gap {check.gap:+.4f}", fontsize=10)
    ax.set_xlabel("PPO iteration")


def _draw_frontier(ax, series, listed: ListedTask | ListedEpisodes, optimum: TiltedOptimum) -> None:
    betas = torch.logspace(-2, 1, 60).tolist()
    curve = [listed.optimum(b) for b in betas]
    ax.plot(
        [c.kl for c in curve], [c.reward for c in curve], color="black", linewidth=1.0, label="exact frontier"
    )
    kl_steps, kl = series[KL]
    score_at = dict(zip(*series[SCORES], strict=True))
    pairs = [(k, score_at[s]) for s, k in zip(kl_steps, kl, strict=True) if s in score_at]
    window = max(1, len(pairs) // 20)
    xs, ys = moving_average([p[0] for p in pairs], window), moving_average([p[1] for p in pairs], window)
    points = ax.scatter(xs, ys, c=range(len(xs)), cmap="viridis", s=6, label="run (smoothed)")
    ax.figure.colorbar(points, ax=ax, label="PPO iteration")
    ax.plot(
        [optimum.kl],
        [optimum.reward],
        marker="*",
        color="tab:red",
        markersize=12,
        linestyle="",
        label="optimum",
    )
    ax.set_xlabel("objective/kl (nats per response)")
    ax.set_ylabel("objective/scores")
    ax.set_title("the run against the exact frontier", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
