"""`python -m lanefuse.lane.cli`: the `lanefuse` command."""

import sys

from lanefuse.lane.cli.main import main

sys.exit(main())
