"""`python -m pipeline.cli` — the same as `kiln`."""

import sys

from pipeline.cli import main

sys.exit(main())
