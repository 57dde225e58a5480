"""``python -m qkwatch.trainer`` and ``torchrun --nproc_per_node N -m qkwatch.trainer``: train a recipe.

The one command of the trainer (see ``qkwatch.trainer.cli``); ``train.py`` is a module, not a script.
"""

import sys

from qkwatch.trainer.cli import main

sys.exit(main())
