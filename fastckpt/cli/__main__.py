"""``python -m fastckpt.cli``."""

from . import run

run()
