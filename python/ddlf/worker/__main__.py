"""``python -m ddlf.worker``: the same as the ``ddlf-worker`` command."""

from .main import run

run()
