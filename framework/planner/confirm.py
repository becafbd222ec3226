"""`--confirm K`: the planner's top K layouts and its two last, run for real for a few steps, their
measured step times beside the predicted ones: Kendall's rank correlation, and the mean absolute
percentage error of the step times, absolute and as ratios to the best (a CPU's matmul rate
drifts between runs; ratios measured in one sitting do not)."""
import statistics
import tempfile
from typing import List, Tuple

from omegaconf import OmegaConf

from framework.launch.local import launch_local
from framework.planner.candidates import Candidate
from framework.planner.cost import Prediction

STEPS = ["trainer.max_steps=6", "trainer.eval_every=null", "trainer.log_every=1", "logger.tensorboard=false",
         "checkpoint.every=null", "trainer.progress_bar=false"]


def kendall_tau(xs: List[float], ys: List[float]) -> float:
    """Concordant minus discordant pairs over all pairs (ties count as neither)."""
    pairs = [(i, j) for i in range(len(xs)) for j in range(i + 1, len(xs))]
    score = sum((xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 for i, j in pairs) - \
        sum((xs[i] - xs[j]) * (ys[i] - ys[j]) < 0 for i, j in pairs)
    return score / max(len(pairs), 1)


def mape(predicted: List[float], measured: List[float]) -> float:
    return 100 * statistics.mean(abs(p - m) / m for p, m in zip(predicted, measured))


def measured_step_s(candidate: Candidate, work: str) -> float:
    cfg = OmegaConf.merge(candidate.cfg, OmegaConf.from_dotlist(STEPS))
    summary = launch_local(cfg, work)
    return statistics.median(summary["step_times_s"][1:])  # the first step warms up


def confirm(ranked: List[Tuple[Candidate, Prediction]], top: int) -> List[Tuple[Candidate, float, float]]:
    """(candidate, predicted, measured) for the top `top` and the last two of `ranked`."""
    chosen = ranked[:top] + [pair for pair in ranked[max(top, len(ranked) - 2):]]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, (candidate, prediction) in enumerate(chosen):
            rows.append((candidate, prediction.step_s, measured_step_s(candidate, f"{work}/{i}")))
    return rows


def report(rows: List[Tuple[Candidate, float, float]]) -> str:
    predicted, measured = [p for _, p, _ in rows], [m for _, _, m in rows]
    best_p, best_m = min(predicted), min(measured)
    lines = ["confirmed (real runs, median step of steps 2-6):",
             "  predicted ms  measured ms  predicted/best  measured/best  layout"]
    for candidate, p, m in rows:
        lines.append(f"  {1000 * p:>12.1f}  {1000 * m:>11.1f}  {p / best_p:>14.2f}  {m / best_m:>13.2f}  "
                     f"{' '.join(candidate.overrides)}")
    lines.append(f"  Kendall tau {kendall_tau(predicted, measured):.2f}; step-time MAPE {mape(predicted, measured):.0f}% "
                 f"absolute, {mape([p / best_p for p in predicted], [m / best_m for m in measured]):.0f}% as ratios "
                 f"to the best; the predicted best runs at {measured[predicted.index(best_p)] / best_m:.2f}x the "
                 f"measured best's step time")
    return "\n".join(lines)
