"""``python -m autopar`` is the ``autopar`` command."""

import sys

from .cli import main

sys.exit(main())
