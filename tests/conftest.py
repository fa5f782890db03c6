"""Shared fixtures for csrun's test-suite (TensorFlow's recorded outputs: see
:mod:`tests.helpers.golden`).

Markers (pyproject.toml): ``python -m pytest`` runs the fast suite, in one process;
``-m "process or slow"`` runs the rest, as ``.ci/run`` does after it. A test not marked
``process`` that starts a process fails (:mod:`tests.helpers.process_starts`).

Fixtures:

``golden``
    ``{case_id: case}`` of every recorded case (``golden["__meta__"]``: the file's meta).
``strategy``
    ``strategy(R, **options)`` builds the golden strategy ``S<R>``:
    ``CentralStorageStrategy([f"CPU:{i}" for i in range(1, R + 1)], "CPU:0")``;
    keyword arguments become :class:`csrun.core.StrategyOptions`.
``decode_golden``
    :func:`decode`: a golden encoding (``{"value", "dtype", "shape"}`` tensors, ``ndarray``,
    ``np_scalar``, ``{"kind", "values"}`` distributed values, ``{"result": ...}``) as torch
    tensors / numpy values / lists.
``expect_golden``
    :func:`expect`: ``expect(actual, encoded, check_dtype=True, atol=1e-6, rtol=0.0)``
    asserts that ``actual`` equals the golden value -- exactly for integers, within
    ``atol`` (+ ``rtol`` * |expected|) for floats; lists/tuples/dicts (and the components of
    a DistributedValues) element by element.
``spec_string``
    renders csrun's ``element_spec`` the way TF prints specs, to compare with the golden.
``work_clock``
    replicas are timed by a :class:`~tests.helpers.work_clock.WorkClock` (``work_clock.work(s)``
    in a replica), not by the machine's clock, which a loaded machine stretches.
``big_cpu_index``
    a logical CPU index that does not exist (logical CPUs: ``max(8, os.cpu_count())``).
``tiny``
    :data:`~tests.helpers.tiny_config.TINY` in ``tmp_path/tiny.yaml`` (the CLI and the
    integration tests' conftest.py write their variant).
``csrun``, ``spawn``
    the real ``csrun`` as a process in ``tmp_path`` (waited for, or a Popen), in
    :func:`~tests.helpers.cli.child_env`'s environment.
"""

import subprocess

import pytest

import csrun.core as cs
from tests.helpers import golden as recorded
from tests.helpers import process_starts
from tests.helpers import work_clock as clocks
from tests.helpers.cli import child_env, csrun_command
from tests.helpers.tiny_config import TINY


@pytest.fixture(autouse=True)
def _starts_no_process_unless_marked(request):
    if request.node.get_closest_marker("process"):
        yield
        return
    with process_starts.watch() as started:
        yield
    if started:
        pytest.fail(f"the test started {len(started)} process(es) "
                    f"({', '.join(sorted(set(started)))}): mark it @pytest.mark.process",
                    pytrace=False)


@pytest.fixture(scope="session")
def golden() -> dict:
    """Every golden case by id (``golden["__meta__"]`` holds the file's meta)."""
    return recorded.cases()


@pytest.fixture
def strategy():
    """Factory fixture: ``strategy(R, copy_parameters=..., ...)`` -> S<R>."""
    return recorded.make_strategy


@pytest.fixture
def decode_golden():
    """The :func:`~tests.helpers.golden.decode` helper: golden encoding -> torch/numpy/Python
    values."""
    return recorded.decode


@pytest.fixture
def expect_golden():
    return recorded.expect


@pytest.fixture
def spec_string():
    return recorded.tf_spec_string


@pytest.fixture
def work_clock(monkeypatch):
    return clocks.install(monkeypatch)


@pytest.fixture
def big_cpu_index() -> int:
    """A logical CPU index that does not exist here (logical CPUs: max(8, cpu_count))."""
    return max(99, cs.logical_cpu_count())


@pytest.fixture
def csrun(tmp_path):
    """``csrun(*args, timeout=300, cwd=tmp_path, command=None, env=None)`` runs the real CLI
    (or ``command``) and waits: a CompletedProcess with text stdout and stderr. ``env``
    adds to the environment; bytes arguments go as they are."""
    def run(*args, timeout=300, cwd=tmp_path, command=None, env=None):
        args = [a if isinstance(a, bytes) else str(a) for a in args]
        return subprocess.run((command or csrun_command()) + args, cwd=cwd,
                              env={**child_env(), **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
    return run


@pytest.fixture
def spawn(tmp_path):
    """``spawn(*args, cwd=tmp_path, command=None, env=None)`` starts the real CLI without
    waiting (a Popen, text pipes); whatever still runs when the test ends is killed."""
    started = []

    def start(*args, cwd=tmp_path, command=None, env=None):
        process = subprocess.Popen((command or csrun_command()) + [str(a) for a in args],
                                   cwd=cwd, env={**child_env(), **(env or {})},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(process)
        return process
    yield start
    for process in started:  # a failed test must not leave a training process behind
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.fixture
def tiny(tmp_path):
    """Path of the tiny config, written to ``tmp_path/tiny.yaml``."""
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path
