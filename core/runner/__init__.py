"""The runner layer: the training session and a parameter-server task's cluster role,
checkpoints, preflight, events, outputs (metrics, plots) and the local launcher. The top
layer: it may import from every other one, and nothing in ``csrun.core`` imports it.
"""
