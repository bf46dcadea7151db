"""``python -m deepcee.cli``: the ``deepcee`` command."""

import sys

from deepcee.cli import main

sys.exit(main())
