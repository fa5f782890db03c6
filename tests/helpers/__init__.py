"""What the tests share, one module a concept; conftest.py files only wrap these in fixtures.

``cli``              the real ``csrun`` as a process: its command and environment
``tiny_config``      the tiny config the tests train, and its variants
``golden``           TensorFlow's recorded outputs, decoded and compared
``ps_plan``          TF's recorded parameter-server plan, and csrun's answers to its cases
``clean_failure``    the rules every rejected input follows (``csrun validate`` outcomes)
``broken_configs``   hypothesis strategies that break a valid config
``injected_faults``  a user model that fails on cue (NaN, inf, an exception)
``crash_driver``     a script: ``csrun`` killed at a point of writing a checkpoint
``cluster_tasks``    the tasks of a parameter-server job as ``csrun train`` processes
``ps_cluster``       ps tasks serving in threads of the test's process, and a worker
``ps_task``          a script: one task of a test cluster through the library
``replica_training`` a few SGD steps through a strategy, as bytes, to compare modes
``soak_checks``      what a soak samples and the limits it must stay within
``process_starts``   which processes a test starts (the fast suite starts none)
``work_clock``       the clock replicas are timed by, moved only by their stated work
``call_count``       the Python functions a call enters, counted (the engine's own work)
"""
