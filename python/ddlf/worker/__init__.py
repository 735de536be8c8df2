"""The worker daemon (``ddlf-worker``): the second program of ddlf, one per node or GPU.

:mod:`.main` is the command (arguments, process set-up, serving), :mod:`.executor` runs each request on the
daemon's interpreter thread, :mod:`.memory_budget` enforces ``--max-memory``, :mod:`.drain` is what SIGTERM does to
a worker serving a run, and :mod:`.collective` is a worker's side of a ring reduction. Nothing here runs on the
master; the training replica (:mod:`ddlf.training.replica`) and the dataset store (:mod:`ddlf.data.store`) are the
worker-side halves of their own concepts.
"""
