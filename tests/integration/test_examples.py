"""The examples of your own training (examples/) train end to end through the CLI, from
the examples folder, on 2 logical CPU replicas."""

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers.cli import csrun_command

pytestmark = pytest.mark.process  # each example as a process

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name, accuracy", [("text_classifier", 0.9), ("image_cnn", 0.9)])
def test_example_trains_from_its_folder(name, accuracy, tmp_path):
    result_path = tmp_path / "result.json"
    done = subprocess.run(csrun_command() + ["train", f"{name}.yaml", "--json",
                                             str(result_path)],
                          cwd=EXAMPLES, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(result_path.read_text())
    assert result["status"] == "completed"
    assert result["strategy"]["replicas"] == 2
    assert result["metrics"]["eval_accuracy"] >= accuracy
    assert result["losses"][-1] < result["losses"][0]
