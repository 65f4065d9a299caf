"""`python -m matryoshka2d.cli ...` runs the `matryoshka2d` command."""

import sys

from matryoshka2d.cli import main

sys.exit(main())
