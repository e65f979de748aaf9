"""``python -m flce.autotune`` is the ``flce-autotune`` command."""

import sys

from flce.autotune.cli import main

sys.exit(main())
