"""`python -m node.cli ...` runs the `tessera` command line."""

import sys

from node.cli.main import main

sys.exit(main())
