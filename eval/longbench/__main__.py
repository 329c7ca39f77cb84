"""``python -m eval.longbench ...`` is ``d3d eval longbench ...``."""

import sys

from d3d.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "longbench", *sys.argv[1:]]))
