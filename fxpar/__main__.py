"""``python -m fxpar``: the command line (:func:`fxpar.cli.main`)."""

import sys

from fxpar.cli import main

sys.exit(main())
