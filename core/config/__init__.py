"""The config layer: YAML loading with file:line, overrides, the pydantic schema, the
problems it reports, and the generated reference. Imports from :mod:`csrun.core.cluster`
and :mod:`csrun.core.distribute` below it, never from data or the runner above.
"""
