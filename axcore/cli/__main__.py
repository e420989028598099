"""`python -m axcore.cli ...`, the same as the `axcore` console script."""

import sys

from axcore.cli.app import main

sys.exit(main())
