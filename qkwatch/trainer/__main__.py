"""``python -m qkwatch.trainer`` and ``torchrun --nproc_per_node N -m qkwatch.trainer``: train a recipe.

The one command of the trainer (see ``qkwatch.trainer.cli``); ``run/train.py`` is a module, not a script.
A reader that closes the pipe early (``python -m qkwatch.trainer --list | head -3``) ends it quietly
with status 1, as ``qkwatch`` does (``qkwatch.cli.closed_pipe_safe``, the Python docs' recipe; the
trainer may not import the glue, hence these lines of its own).
"""

import os
import sys

from qkwatch.trainer.cli import main

try:
    code = main()
    sys.stdout.flush()  # inside the try: a buffered write to a closed pipe fails here
except BrokenPipeError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail again
    code = 1
sys.exit(code)
