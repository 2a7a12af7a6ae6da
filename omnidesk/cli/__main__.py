"""``python -m omnidesk.cli``: the same as ``omnidesk`` (and ``python -m omnidesk``)."""

import sys

from . import main

sys.exit(main())
