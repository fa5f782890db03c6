"""``--plot PATH``: the loss curve and per-replica step times as an image.

Needs the optional ``matplotlib`` (``pip install 'csrun[plot]'``); drawn off-screen.
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Sequence

__all__ = ["plot_available", "write_plot"]


def plot_available() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def write_plot(path: str, losses: Sequence[float], step_times: Sequence[Sequence[float]],
               devices: Sequence[str], first_step: int = 1) -> None:
    """Two panels: loss per step; each replica's step time per step (this session).

    Args:
      path: the image file (the suffix picks the format: .png, .svg, .pdf).
      losses: the loss of every step, from step 1.
      step_times: per step, each replica's seconds inside ``strategy.run``.
      devices: each replica's device, for the legend.
      first_step: the step of ``step_times[0]`` (a resumed run times only its own steps).
    """
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(range(1, len(losses) + 1), losses, linewidth=1)
    top.set_ylabel("loss")
    top.set_title("csrun training")
    steps = range(first_step, first_step + len(step_times))
    for replica, device in enumerate(devices):
        bottom.plot(steps, [1000 * t[replica] for t in step_times], linewidth=0.8,
                    label=f"replica {replica} ({device})")
    bottom.set_xlabel("step")
    bottom.set_ylabel("step time (ms)")
    bottom.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target)
    plt.close(figure)
