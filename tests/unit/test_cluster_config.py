"""strategy.kind: parameter_server: its cluster and task from the config or TF_CONFIG, and
every way they can be wrong (exit 2 with a dotted path, where it came from, and a hint)."""

import json
import textwrap
import threading
import types

import pytest

from csrun.core.runner.preflight.cluster import TF_CONFIG_ORIGIN, cluster_resolver
from csrun.core.runner.preflight import load_config_text
from csrun.core.config.problems import ConfigError

PS = textwrap.dedent("""\
    strategy:
      kind: parameter_server
    dataset:
      source: {kind: range, stop: 64}
      steps:
        - {op: batch, size: 8}
    model:
      kind: linear
    train:
      steps: 4
    """)
CLUSTER = {"worker": ["127.0.0.1:2223", "127.0.0.1:2224"], "ps": ["127.0.0.1:2222"]}


def tf_config(cluster=CLUSTER, task=("worker", 1)) -> dict:
    data = {"cluster": cluster}
    if task is not None:
        data["task"] = {"type": task[0], "index": task[1]}
    return {"TF_CONFIG": json.dumps(data)}


def load(text=PS, overrides=(), environ=None):
    return load_config_text(text, "c.yaml", overrides, environ=environ or {})


def problems(text=PS, overrides=(), environ=None):
    with pytest.raises(ConfigError) as info:
        load(text, overrides, environ)
    return info.value.problems


def test_central_storage_is_the_default_kind_and_ignores_tf_config():
    text = PS.replace("  kind: parameter_server\n", "  compute_devices: [CPU:0]\n")
    config = load(text, environ={"TF_CONFIG": "{not json"})
    assert config.strategy.kind == "central_storage"
    assert config.strategy.compute_devices == ["CPU:0"]


def test_cluster_and_task_from_tf_config():
    config = load(environ=tf_config())
    assert config.strategy.kind == "parameter_server" and config.strategy.cluster is None
    resolver = cluster_resolver(config.strategy, tf_config())
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.cluster_spec().as_dict() == CLUSTER
    assert config.strategy.parameter_device is None  # variables live on the ps tasks
    assert config.strategy.variable_placement == "round_robin"


def test_cluster_from_the_config_and_task_from_an_override():
    overrides = [f"strategy.cluster={json.dumps(CLUSTER)}", "strategy.task={type: ps}"]
    config = load(overrides=overrides)
    resolver = cluster_resolver(config.strategy, {})
    assert (resolver.task_type, resolver.task_id) == ("ps", 0)
    # the task may come from TF_CONFIG while the cluster comes from the config
    environ = tf_config(CLUSTER, ("worker", 0))
    config = load(overrides=overrides[:1], environ=environ)
    assert cluster_resolver(config.strategy, environ).task_id == 0


def test_no_cluster_anywhere_says_how_to_give_one():
    (problem,) = problems()
    assert problem.path == "strategy.cluster" and problem.where == "c.yaml:1"
    assert "TF_CONFIG" in problem.message and "csrun launch" in problem.hint


SHAPE = "TF_CONFIG holds"


@pytest.mark.parametrize("value, path, says, hint", [
    ("{not json", "strategy.cluster", "TF_CONFIG is not valid JSON (Expecting property name",
     SHAPE),
    ("[1, 2]", "strategy.cluster", "TF_CONFIG must be a JSON object, got list", SHAPE),
    ('{"cluster": {"worker": ["nohost"], "ps": ["h:1"]}}', "strategy.cluster.worker.0",
     "must be 'host:port'", SHAPE),
    ('{"cluster": {"workers": ["h:1"], "ps": ["h:2"]}}', "strategy.cluster.workers",
     "unknown job 'workers'", "did you mean 'worker'?"),
    ('{"cluster": {"worker": ["h:1"], "ps": ["h:2"]}, "task": {"type": "worker", '
     '"index": "1"}}', "strategy.task", 'must be {"type": "worker", "index": 0}', SHAPE),
])
def test_malformed_tf_config_names_tf_config_not_the_file(value, path, says, hint):
    # the path points into TF_CONFIG (its cluster/task standing for strategy.cluster/task)
    (problem,) = problems(environ={"TF_CONFIG": value})
    assert problem.origin == TF_CONFIG_ORIGIN and problem.where == "environment TF_CONFIG"
    assert problem.path == path and says in problem.message
    assert problem.hint.startswith(hint)


def test_task_out_of_range_from_tf_config():
    (problem,) = problems(environ=tf_config(task=("worker", 2)))
    assert problem.path == "strategy.task.index" and problem.origin == TF_CONFIG_ORIGIN
    assert problem.message == "task worker:2 does not exist; the cluster has 2 worker task(s)"
    assert problem.hint == "use 0..1"


def test_task_out_of_range_from_the_file_points_at_its_line():
    text = PS.replace("  kind: parameter_server\n", "  kind: parameter_server\n"
                      f"  cluster: {json.dumps(CLUSTER)}\n"
                      "  task: {type: chief, index: 0}\n")
    (problem,) = problems(text)
    assert problem.path == "strategy.task.index" and problem.where == "c.yaml:4"
    assert "chief:0 does not exist" in problem.message and "no chief" in problem.hint


def test_tasks_csrun_does_not_run_and_missing_task():
    (problem,) = problems(environ=tf_config({**CLUSTER, "evaluator": ["h:9"]},
                                            ("evaluator", 0)))
    assert problem.path == "strategy.task.type" and "'evaluator'" in problem.message
    (problem,) = problems(environ=tf_config(task=None))
    assert problem.path == "strategy.task" and "TF_CONFIG's task" in problem.hint


def test_config_and_tf_config_must_agree():
    other = {"worker": ["127.0.0.1:9"], "ps": ["127.0.0.1:8"]}
    (problem,) = problems(overrides=[f"strategy.cluster={json.dumps(other)}"],
                          environ=tf_config())
    assert problem.path == "strategy.cluster" and "differs from TF_CONFIG" in problem.message
    (problem,) = problems(overrides=["strategy.task={type: worker, index: 0}"],
                          environ=tf_config())
    assert problem.message == "worker:0 differs from TF_CONFIG's task worker:1"
    same = [f"strategy.cluster={json.dumps(CLUSTER)}", "strategy.task={type: worker, index: 1}"]
    assert load(overrides=same, environ=tf_config()).strategy.task.index == 1


def test_cluster_shape_problems_all_at_once():
    cluster = {"chief": ["h:1", "h:2"], "worker": [], "ps": []}
    found = problems(overrides=[f"strategy.cluster={json.dumps(cluster)}",
                                "strategy.task={type: chief}"])
    assert {p.path for p in found} == {"strategy.cluster.ps", "strategy.cluster.chief"}
    (problem,) = problems(overrides=['strategy.cluster={worker: [], ps: ["h:1"]}',
                                     "strategy.task={type: ps}"])
    assert problem.path == "strategy.cluster.worker" and "no worker" in problem.message


def test_a_bad_address_in_the_file_has_its_path_and_line():
    text = PS.replace("  kind: parameter_server\n", "  kind: parameter_server\n"
                      "  cluster:\n    worker: [h:1, 'h:99999']\n    ps: [h:2]\n")
    (problem,) = problems(text, environ=tf_config({"worker": ["h:1", "h:99999"],
                                                   "ps": ["h:2"]}))
    assert problem.path == "strategy.cluster.worker.1" and problem.where == "c.yaml:4"
    assert "'h:99999' is not 'host:port' with a port in 1..65535" == problem.message


def test_settings_of_the_other_kind_say_which_kind_has_them():
    text = PS.replace("  kind: parameter_server\n", "  cluster: {}\n")
    (problem,) = problems(text)
    assert problem.path == "strategy.cluster" and problem.message == "unknown key"
    assert problem.hint == "`cluster` is a setting of strategy kind: parameter_server"
    found = problems(overrides=["strategy.parameter_device=CPU:0"], environ=tf_config())
    assert found[0].path == "strategy.parameter_device"
    assert found[0].hint == "`parameter_device` is a setting of strategy kind: central_storage"
    (problem,) = problems(overrides=["strategy.kind=parameter_servers"])
    assert problem.path == "strategy.kind" and "did you mean 'parameter_server'" in problem.hint


def test_settings_that_cannot_work_in_a_cluster():
    found = problems(overrides=["strategy.compute_devices=[CPU:0]",
                                "strategy.num_gpus_per_worker=1"], environ=tf_config())
    assert {p.path for p in found} == {"strategy.num_gpus_per_worker"}
    (problem,) = problems(overrides=["strategy.num_gpus_per_worker=64"], environ=tf_config())
    assert problem.path == "strategy.num_gpus_per_worker" and "GPU:" in problem.message
    (problem,) = problems(overrides=["strategy.variable_placement=even"], environ=tf_config())
    assert problem.path == "strategy.variable_placement"


def test_per_replica_batches_work_in_a_cluster_and_divide_among_all_its_replicas():
    # each worker reads its share through its own input pipeline (TF's dataset per worker)
    config = load(overrides=["dataset.distribute=per_replica"], environ=tf_config())
    assert config.dataset.distribute == "per_replica"
    # 2 workers x 2 replicas: 8 divides among 4; 6 divides among a worker's 2, not all 4
    load(overrides=["dataset.distribute=per_replica", "strategy.compute_devices=[CPU:0, "
                    "CPU:1]"], environ=tf_config())
    (problem,) = problems(overrides=["dataset.distribute=per_replica",
                                     "strategy.compute_devices=[CPU:0, CPU:1]",
                                     "dataset.steps.0.size=6"], environ=tf_config())
    assert problem.path == "dataset.steps.0.size"
    assert problem.message == ("the global batch size 6 does not divide among the job's 4 "
                               "replicas (2 workers x 2; distribute: per_replica)")
    assert problem.hint == "use a multiple of 4, e.g. 4"
    # one that does not divide among a worker's own replicas is reported once
    (problem,) = problems(overrides=["dataset.distribute=per_replica",
                                     "strategy.compute_devices=[CPU:0, CPU:1]",
                                     "dataset.steps.0.size=7"], environ=tf_config())
    assert problem.path == "dataset.steps.0.size" and "among 2 replicas" in problem.message


@pytest.mark.parametrize("size, workers, ok", [(1, 2, False), (2, 2, True), (4, 3, False),
                                              (5, 3, True), (3, 2, True)])
def test_a_global_batch_that_leaves_a_worker_nothing_is_refused(size, workers, ok):
    cluster = {"worker": [f"127.0.0.1:{2223 + i}" for i in range(workers)],
               "ps": ["127.0.0.1:2222"]}
    overrides = [f"dataset.steps.0.size={size}"]
    if ok:
        load(overrides=overrides, environ=tf_config(cluster))
        return
    (problem,) = problems(overrides=overrides, environ=tf_config(cluster))
    assert problem.path == "dataset.steps.0.size"
    assert f"a global batch of {size} over {workers} workers leaves the last worker no " \
           "example in any step" in problem.message


def test_a_chief_that_fails_while_setting_up_still_ends_the_job(monkeypatch):
    # else the ps tasks serve forever and the other workers wait for the chief's init
    from csrun.core.runner import cluster_role as cluster_runner

    aborted = []
    extended = types.SimpleNamespace(is_ps=False, is_chief=True, abort=aborted.append)
    monkeypatch.setattr(cluster_runner, "connect",
                        lambda config, stop: types.SimpleNamespace(extended=extended))
    monkeypatch.setattr(cluster_runner, "_joined",
                        lambda strategy, config: types.SimpleNamespace(task="worker:0"))
    monkeypatch.setattr(cluster_runner, "_agree_on_the_job", lambda *args: None)

    def broken_session(*args):
        raise OSError("data file vanished")
    monkeypatch.setattr(cluster_runner, "Session", broken_session)
    with pytest.raises(OSError, match="vanished"):
        cluster_runner.run_task(None, False, None, lambda event: None, threading.Event())
    assert aborted == ["worker:0 failed: OSError: data file vanished"]


@pytest.mark.timeout(30)
def test_workers_waiting_for_the_chief_hear_its_abort():
    import datetime

    import torch.distributed as dist

    from csrun.core.cluster.coordinator import JobCoordinator
    from csrun.core.cluster.transport import ParameterServerError

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    client = JobCoordinator.__new__(JobCoordinator)  # only its store is used
    client.store, client.stop, client.watch, client._heard = store, None, None, []
    threading.Timer(0.3, lambda: store.set("job/aborted", "the chief ended the job: "
                                           "worker:0 failed: OSError: x")).start()
    # heard: waiting out the 20 s would raise "did not initialize the variables" instead
    with pytest.raises(ParameterServerError,
                       match="^the chief ended the job: worker:0 failed: OSError: x$"):
        client.wait_initialized(20)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_worker_whose_store_host_dies_gets_the_clear_ps_error():
    # ps:0 hosts the job's store: when it dies while a worker counts a step (not only
    # while it talks to a ps), the worker must still say which ps and that it cannot go on
    import datetime
    import subprocess
    import sys

    import torch.distributed as dist

    from csrun.core.runner.launch import free_ports
    from csrun.core.cluster.coordinator import JobCoordinator, _job_store
    from csrun.core.cluster.transport import ParameterServerError

    (port,) = free_ports(1)
    host = subprocess.Popen(
        [sys.executable, "-c", "import time, torch.distributed as d; "
         f"s = d.TCPStore('127.0.0.1', {port}, 2, True, wait_for_workers=False); "
         "print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        raw = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=5))
        client = JobCoordinator.__new__(JobCoordinator)  # only its store and task list
        client.store = _job_store(raw, f"127.0.0.1:{port}", "worker:1", 5)
        client.watch, client.workers = None, ["worker:0", "worker:1"]
        assert client.global_step == 0
        host.kill()
        host.wait()
        with pytest.raises(ParameterServerError) as info:
            for _ in range(50):  # the first call after the kill may still be answered
                client.global_step
        message = str(info.value)
        assert "ps:0" in message and "worker:1" in message and "cannot go on" in message
    finally:
        host.kill()


@pytest.mark.timeout(30)
def test_the_first_failure_is_the_jobs_reason_and_each_task_counts_reading_it_once():
    import datetime

    import torch.distributed as dist

    from csrun.core.cluster.coordinator import ServerBooks, read_abort, record_abort
    from csrun.core.cluster.transport import BoundedStore

    store = BoundedStore(dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=10)), 10, "store")
    heard: list = []
    assert read_abort(store, heard) is None and store.add("job/heard", 0) == 0
    record_abort(store, "ps:1 failed on a request of worker:0: KeyError: 'shard 7'")
    record_abort(store, "the chief ended the job: worker:0 failed: JobAborted: ...")
    for _ in range(2):  # the first failure stays; one task is counted once
        assert read_abort(store, heard) == \
            "ps:1 failed on a request of worker:0: KeyError: 'shard 7'"
    assert store.add("job/heard", 0) == 1
    stop = threading.Event()
    stop.set()  # a signal ends ps:0's wait for the others at once
    ServerBooks(store, 0).wait_heard(3, 20, 0.01, stop)
