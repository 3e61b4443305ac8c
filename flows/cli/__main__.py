"""``python -m flows.cli``: the ``kiln`` command line."""

import sys

from flows.cli import main

sys.exit(main())
