"""``python -m trainer`` and ``torchrun --nproc_per_node N -m trainer``: train a recipe (see ``trainer.cli``)."""

import sys

from qkwatch.trainer.cli import main

sys.exit(main())
