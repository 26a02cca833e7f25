"""``python -m flexpack``: the ``flexpack`` command line."""

import sys

from flexpack.cli import main

sys.exit(main())
