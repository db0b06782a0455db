"""`kerasps.cli`: the `kerasps` command, `python -m kerasps.cli`; it lives in `kerasps.ops.cli`."""

import sys

from kerasps.ops.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
