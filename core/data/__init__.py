"""The data layer: dataset sources and the input pipeline, beside the bundled digits.
Imports from :mod:`csrun.core.config` and the layers below it.
"""
