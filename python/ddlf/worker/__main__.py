"""``python -m ddlf.worker``: the same as the ``ddlf-worker`` command."""

import sys

from .main import main

sys.exit(main())
