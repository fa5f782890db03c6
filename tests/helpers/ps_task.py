"""One task of a test cluster (run as a script with TF_CONFIG set).

Knobs (environment): PS_STEPS (steps to train), PS_DIE_AT (os._exit(3) after that step),
PS_RESULT (where to write the result JSON; PS_RESULT + ".progress" holds the steps done),
PS_SLEEP (seconds between steps), PS_HOLD (a file that must exist before the task
finishes: tests use it to keep the chief alive while another worker restarts), PS_GO (a
file that must exist before the first step; PS_RESULT + ".ready" says the task waits).
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from csrun.core.cluster.transport import ParameterServerError
from csrun.core import ParameterServerStrategy


def main() -> int:
    try:
        return train()
    except ParameterServerError as exc:
        print(f"csrun: {exc}", file=sys.stderr)
        return 1


def train() -> int:
    strategy = ParameterServerStrategy(timeout=60)
    ext = strategy.extended
    if ext.is_ps:
        ext.join()
        return 0
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + ext.replica_offset)
    x_all = torch.randn(512, 4, generator=data)
    y_all = x_all.sum(1, keepdim=True)
    steps, die_at = int(os.environ["PS_STEPS"]), int(os.environ.get("PS_DIE_AT", "-1"))
    losses = []

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss.detach()

    progress = os.environ["PS_RESULT"] + ".progress"
    if os.environ.get("PS_GO"):  # start together: say so, then wait for the word
        open(os.environ["PS_RESULT"] + ".ready", "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.environ["PS_GO"]) and time.monotonic() < deadline:
            time.sleep(0.01)
    for i in range(steps):
        j = (i * 16) % 512
        optimizer.zero_grad()
        losses.append(float(strategy.run(step, args=(x_all[j:j + 16], y_all[j:j + 16]))))
        optimizer.step()
        with open(progress, "w") as f:
            f.write(str(i + 1))
        if i == die_at:
            os._exit(3)
        time.sleep(float(os.environ.get("PS_SLEEP", "0.01")))
    while os.environ.get("PS_HOLD") and not os.path.exists(os.environ["PS_HOLD"]):
        time.sleep(0.05)
    reported = []
    lost = ext.finish(timeout=60, report=lambda task, why: reported.append(task))
    result = {"losses": losses, "lost": lost, "reported": reported,
              "placement": [ext.variable_device(p) for p in model.parameters()],
              "chief": ext.is_chief,
              "logs": [log["recent"] for log in ext.ps_logs] if ext.is_chief else None}
    with open(os.environ["PS_RESULT"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
