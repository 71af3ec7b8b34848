"""``python -m hybridfp.train``: the same as ``hybridfp train``."""

import sys

from .cli import train_main

sys.exit(train_main())
