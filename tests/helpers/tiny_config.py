"""The tiny config the tests train."""

# 2 logical CPU replicas, a few steps a second.
TINY = """\
strategy: {compute_devices: [CPU:0, CPU:1], parameter_device: CPU:0}
dataset:
  source: {kind: synthetic, examples: 96, features: 6, classes: 3}
  holdout: 0.25
  steps:
    - {op: shuffle, buffer: 128}
    - {op: batch, size: 16}
model: {kind: mlp, hidden: [16]}
optimizer: {name: Adam, lr: 0.01}
train: {steps: 40, log_every: 10}
"""
