"""``python -m d3d`` is the ``d3d`` command."""

import sys

from d3d.cli import main

sys.exit(main())
