import sys

from fxpar.cli import main

sys.exit(main())
