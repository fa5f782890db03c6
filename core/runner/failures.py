"""Where a run failed in the user's code: the step (or the evaluation), the replica and
its device, the config key that brought the code in, and the user's ``file:line``.

An exception from a replica's model or loss reaches the caller of ``strategy.run`` with
the replica that raised it (the engine records it); :func:`located` turns it into a
:class:`~csrun.core.config.user_code.UserCodeError` that says all of it, whatever the
loss kind::

    step 5, replica 1 (CPU:1): model.target: mypkg.models:Net (loss cross_entropy)
    failed: ValueError: bad shape (at mypkg/models.py:31)
"""

from __future__ import annotations

from typing import Sequence

from ..cluster.transport import ParameterServerError
from ..config.problems import ConfigError
from ..config.user_code import UserCodeError, describe_failure
from ..data.pipeline import is_worker_death
from .errors import RunError

__all__ = ["located", "PASSED_ON"]

# csrun's own verdicts, already worded for the user: they pass unchanged (a ps that failed
# while a replica looked up table rows is the cluster's failure, not the user's code's)
PASSED_ON = (ConfigError, RunError, ParameterServerError)


def located(exc: Exception, where: str, objective, devices: Sequence[str]) -> Exception:
    """``exc`` (raised by a replica's model or loss) as a :class:`UserCodeError` that
    names ``where`` (``"step 5"``, ``"the evaluation after step 9"``), the replica and
    the code; csrun's own errors (:data:`PASSED_ON`) as they are."""
    if isinstance(exc, PASSED_ON) or is_worker_death(exc):  # run_session names the data
        return exc
    replica = getattr(exc, "csrun_replica_id", None)
    if replica is not None and replica < len(devices):
        where += f", replica {replica} ({devices[replica]})"
    if isinstance(exc, UserCodeError):  # the loss function's: it named itself
        error, cause = UserCodeError(f"{where}: {exc.message}", exc.hint), \
            exc.__cause__ or exc
    else:
        error, cause = UserCodeError(f"{where}: {objective.field}: "
                                     f"{describe_failure(objective.what, exc)}"), exc
    error.__cause__ = cause
    return error
