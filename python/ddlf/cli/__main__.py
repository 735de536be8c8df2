"""``python -m ddlf.cli``: the same as the ``ddlf`` command."""

import sys

from .main import main

sys.exit(main())
