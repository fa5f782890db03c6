"""``sys.exit`` in user code (round 2, item 3): at the import of a model or map module,
or inside a replica, it ended the run with exit 0, no message and no ``--json``. Only
csrun decides a run's exit code: an exit during training is a failure (exit 1), named;
one at import is the config's problem (exit 2, round 3: tests/cli/test_user_exit_at_check.py)."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.cli import child_env
from tests.helpers.tiny_config import TINY

pytestmark = pytest.mark.process  # csrun processes

USER_CODE = '''\
import os, sys
import torch
from torch import nn

if os.environ.get("EXIT_AT") == "import":
    sys.exit(0)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(6, 3)

    def forward(self, x):
        # in training, not in the config check's run on the meta device (an exit there
        # is a config problem)
        if os.environ.get("EXIT_AT") == "replica" and x.device.type != "meta":
            raise SystemExit(0)  # as sys.exit(0), or argparse's exit, would
        return self.layer(x)


def parse(x, y):
    if os.environ.get("EXIT_AT") == "map":
        import argparse
        argparse.ArgumentParser().parse_args(["--help"])  # prints help, exits 0
    return x, y
'''


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["import", "replica", "map"])
def test_an_exit_in_user_code_is_a_failure(where, csrun, tmp_path):
    (tmp_path / "user_code.py").write_text(USER_CODE)
    config = tmp_path / "user.yaml"
    config.write_text(TINY.replace("model: {kind: mlp, hidden: [16]}",
                                   "model: {kind: import, target: 'user_code:Model'}")
                      .replace("    - {op: batch", "    - {op: map, fn: 'user_code:parse'}\n"
                               "    - {op: batch"))
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    env["EXIT_AT"] = where
    done = csrun("train", config, "--json", "out.json", env=env, timeout=120)
    assert "Traceback" not in done.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    if where == "import":
        assert done.returncode == 2, (done.returncode, done.stderr)
        assert "importing module 'user_code' exited: sys.exit(0)" in done.stderr
        assert result["status"] == "invalid" and result["exit_code"] == 2
        return
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "SystemExit" in done.stderr and "exited" in done.stderr, done.stderr
    assert result["status"] == "failed" and result["exit_code"] == 1
    assert "SystemExit" in result["error"]
