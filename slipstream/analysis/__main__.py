"""`python -m slipstream.analysis ...`: the `slipstream analyze` command alone."""
import sys

from slipstream.analysis.cli import main

sys.exit(main())
