"""TF 2.21's recorded placement (``tests/golden/ps_plan.json``) through a real
``ParameterServerStrategy``: variables created in its scope (``colocate_vars_with``
included) against ps tasks serving in threads of this process, read back with
``strategy.extended.variable_device``. The unit test (``test_ps_plan_golden.py``) replays
every case through the plan alone; this one checks, on a sample, that the strategy
places what the plan says."""

from __future__ import annotations

import threading

import pytest
import torch

import csrun.core as cs
from csrun.core.runner.launch import free_ports
from tests.helpers.ps_plan import TORCH_DTYPES, cases, check_error, error, make_partitioner

pytestmark = pytest.mark.timeout(120)

SAMPLE = ["plan/ps2/round_robin/mixed", "plan/ps3/round_robin/mixed",
          "plan/ps2/round_robin/zero_rows", "plan/ps3/colocate/issue_37",
          "plan/ps4/colocate/chain", "plan/ps2/colocate/interleaved",
          "plan/ps3/colocate/fixed(2)/with_whole", "plan/ps2/colocate/fixed(2)/with_partitioned",
          "plan/ps3/fixed(3)/sequence", "plan/ps3/fixed(2)/rows1",
          "plan/ps3/min_size(16,4)/[10, 4]/float32", "plan/ps2/custom([2])/[4, 4]",
          "plan/ps2/custom([2, 1])/[4, 4]"]
# csrun's answers that differ today (see KNOWN_DIFFERENCES in test_ps_plan_golden.py; the
# others were fixed with the cluster rewrite: their strict xfails passed)
KNOWN_DIFFERENCES = {
    "plan/ps2/colocate/fixed(2)/with_partitioned":
        "colocated with a partitioned variable: TF on the coordinator, csrun on its first ps",
}


class Cluster:
    """``num_ps`` ps tasks serving in threads of this process, and one worker."""

    def __init__(self, num_ps: int, partitioner):
        ports = free_ports(num_ps + 1)
        self.spec = {"worker": [f"127.0.0.1:{ports[0]}"],
                     "ps": [f"127.0.0.1:{p}" for p in ports[1:]]}
        self.threads = [threading.Thread(target=self._serve, args=(k,), daemon=True)
                        for k in range(num_ps)]
        for thread in self.threads:
            thread.start()
        self.strategy = cs.ParameterServerStrategy(
            cluster_spec=self.spec, task_type="worker", task_id=0, timeout=60,
            variable_partitioner=partitioner)

    def _serve(self, k: int) -> None:
        cs.ParameterServerStrategy(cluster_spec=self.spec, task_type="ps", task_id=k,
                                   timeout=60).extended.join()

    def close(self) -> None:
        self.strategy.extended.finish(timeout=30)
        for thread in self.threads:
            thread.join(timeout=30)


def ps_of(device: str) -> int:
    return int(device.split("/task:")[1].split("/")[0])


def placed(case: dict) -> dict:
    """Where the strategy put each of the case's variables: the ps of each shard."""
    cluster = Cluster(case["num_ps"], make_partitioner(case["partitioner"]))
    strategy, made = cluster.strategy, []
    try:
        with strategy.scope():
            for spec in case["variables"]:
                value = torch.zeros(spec["shape"], dtype=TORCH_DTYPES[spec["dtype"]])
                if spec["colocate_with"] is None:
                    made.append(cs.Variable(value))
                else:
                    with strategy.extended.colocate_vars_with(made[spec["colocate_with"]]):
                        made.append(cs.Variable(value))
        strategy.run(lambda: None)  # registers the variables with the ps tasks
        return {"ps": [[ps_of(d) for d in strategy.extended.variable_device(v.tensor).split(",")]
                       for v in made]}
    except Exception as exc:  # noqa: BLE001 -- compared with TF's error
        return error(exc)
    finally:
        cluster.close()


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c["id"], marks=[pytest.mark.xfail(
        strict=True, reason=KNOWN_DIFFERENCES[c["id"]])] if c["id"] in KNOWN_DIFFERENCES else [])
    for c in cases("plan") if c["id"] in SAMPLE])
def test_the_strategy_places_variables_where_tf_does(case):
    got, tf = placed(case), case["tf"]
    if "error" in tf:
        return check_error(got, tf)
    assert "error" not in got, f"TF places {tf['variables']}; csrun raises {got}"
    assert got["ps"] == [[shard["ps"] for shard in v] for v in tf["variables"]]


def test_the_sample_is_in_the_golden():
    assert sorted(c["id"] for c in cases("plan") if c["id"] in SAMPLE) == sorted(SAMPLE)
