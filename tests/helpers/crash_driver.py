"""Run ``csrun`` and kill it (SIGKILL, as a power cut or the OOM killer would) at one
point of writing one checkpoint.

    python crash_driver.py POINT STEP [csrun arguments ...]

``POINT``: ``write`` -- half of the payload is in its temp file; ``rename`` -- the payload
is complete and fsynced in its temp file, not yet renamed into place; ``manifest`` -- the
payload is in place, its manifest not yet. ``STEP``: the step of the checkpoint.
"""

from __future__ import annotations

import io
import os
import signal
import sys

import torch


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _install(point: str, step: int) -> None:
    name = f"ckpt-{step:08d}"
    real_replace, real_save = os.replace, torch.save

    def replace(src, dst, *args, **kwargs):
        target = os.path.basename(dst)
        if (point, target) in (("rename", f"{name}.pt"), ("manifest", f"{name}.json")):
            _die()
        return real_replace(src, dst, *args, **kwargs)

    def save(obj, f, *args, **kwargs):
        if point == "write" and isinstance(obj, dict) and obj.get("step") == step:
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
            f.flush()
            _die()
        return real_save(obj, f, *args, **kwargs)

    os.replace, torch.save = replace, save


if __name__ == "__main__":
    _install(sys.argv[1], int(sys.argv[2]))
    from csrun.cli.main import main
    sys.argv = ["csrun", *sys.argv[3:]]
    main()
