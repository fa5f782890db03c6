"""``python -m csrun.cli``: the ``csrun`` console script (what ``csrun launch`` starts its
tasks with), Ctrl-C handled from the first instant (:mod:`csrun.cli.entry`)."""

import sys

from csrun.cli.entry import main

sys.exit(main())
