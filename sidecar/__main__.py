"""``python -m sidecar``: the same as the ``sidecar`` command."""

import sys

from sidecar.cli import main

sys.exit(main())
