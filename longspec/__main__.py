"""``python -m longspec``: the ``longspec`` command."""
import sys

from longspec.cli import main

sys.exit(main())
