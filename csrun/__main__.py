"""``python -m csrun``: the ``csrun`` command (:mod:`csrun.cli.entry`).

This folder holds only this file: ``csrun`` is a namespace package (no ``__init__.py``),
and Python runs a namespace package's ``__main__`` like a regular package's.
"""

import sys

from csrun.cli.entry import main

sys.exit(main())
