"""csrun's test-suite: a package, so that tests import their helpers as ``tests.helpers``
(the repository root is on ``sys.path``: pytest's ``pythonpath``, or ``child_env()`` for a
``csrun`` process)."""
