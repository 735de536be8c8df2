"""The ``ddlf`` command: status, logs, ``up``/``down`` of a cluster described by ``cluster.toml``."""
