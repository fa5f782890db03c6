"""What ``csrun`` imports to start (issue 27): help and the version without torch;
``validate`` without torch's compiler unless torch itself asks for it. Each check runs
in a fresh interpreter (a test process has long imported torch); the times themselves
are benchmarks/startup.py's, not a test's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.process

_RUN = """
import json, sys
sys.argv = ["csrun", *{args!r}]
from csrun.cli.main import app
try:
    app()
except SystemExit as exc:
    code = exc.code
print(json.dumps({{"code": code, "modules": sorted(sys.modules)}}), file=sys.stderr)
"""


def _modules(*args: str, before: str = "", cwd=None) -> tuple[int, set[str]]:
    done = subprocess.run([sys.executable, "-c", before + _RUN.format(args=list(args))],
                          capture_output=True, text=True, timeout=300, cwd=cwd)
    last = done.stderr.strip().splitlines()[-1]
    data = json.loads(last)
    return data["code"], set(data["modules"])


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["train", "--help"],
                                  ["validate", "--help"], ["launch", "--help"],
                                  ["inspect-devices", "--help"]])
def test_help_and_version_do_not_import_torch(args):
    code, modules = _modules(*args)
    assert code in (0, None)
    assert "csrun.cli.main" in modules  # the command line did load
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "numpy")
                   or m.startswith("csrun.core"))
    assert not heavy, heavy


# torch builds its optimizers and its meta-device kernels with functions that import
# torch._dynamo on their first call (torch._compile._disable_dynamo); answered here from
# the functions themselves, so that only an import by csrun would still load it.
_TORCH_OWN_IMPORTS_ANSWERED = """
import gc, torch, torch._compile
import csrun.core.runner.preflight
_inner = [c for c in torch._compile._disable_dynamo.__code__.co_consts
          if getattr(c, "co_name", None) == "inner"]
answered = 0
for obj in gc.get_objects():
    if callable(obj) and getattr(obj, "__code__", None) in _inner:
        fn = obj.__closure__[obj.__code__.co_freevars.index("fn")].cell_contents
        fn.__dynamo_disable = fn
        answered += 1
assert answered > 10, answered
"""


def test_validate_leaves_the_compiler_to_torch(tiny):
    code, modules = _modules("validate", str(tiny), before=_TORCH_OWN_IMPORTS_ANSWERED)
    assert code in (0, None)
    assert "torch._dynamo" not in modules
    code, modules = _modules("validate", str(tiny))  # torch's own first optimizer does
    assert code in (0, None) and "torch._dynamo" in modules
