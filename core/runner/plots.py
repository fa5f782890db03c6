"""``--plot PATH``: the loss curve and per-replica step times as an image.

Needs the optional ``matplotlib`` (``pip install 'csrun[plot]'``); drawn off-screen.
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Sequence

from .curve import Curve

__all__ = ["plot_available", "write_plot"]


def plot_available() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def write_plot(path: str, losses: Curve, step_times: Sequence[Curve],
               devices: Sequence[str], first_step: int = 1) -> None:
    """Two panels: the loss curve; each replica's step time (this session).

    Args:
      path: the image file (the suffix picks the format: .png, .svg, .pdf).
      losses: the run's loss curve, from step 1.
      step_times: each replica's seconds inside ``strategy.run`` per step, as curves.
      devices: each replica's device, for the legend.
      first_step: the first step this session timed (a resumed run times only its own).
    """
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(*_steps_and_values(losses, 1), linewidth=1)
    top.set_ylabel("loss")
    top.set_title("csrun training")
    for replica, (device, times) in enumerate(zip(devices, step_times)):
        steps, seconds = _steps_and_values(times, first_step)
        bottom.plot(steps, [1000 * t for t in seconds], linewidth=0.8,
                    label=f"replica {replica} ({device})")
    bottom.set_xlabel("step")
    bottom.set_ylabel("step time (ms)")
    bottom.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target)
    plt.close(figure)


def _steps_and_values(curve: Curve, first_step: int) -> tuple[list[int], list[float]]:
    """Each point of ``curve`` at the last step it covers."""
    values = curve.points()
    steps = [first_step - 1 + min((i + 1) * curve.every, curve.steps)
             for i in range(len(values))]
    return steps, values
