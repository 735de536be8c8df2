"""Benchmarks: ``python -m benchmarks NAME`` runs one and records its numbers in BENCHMARKS.md.

Every benchmark measures ddlf side by side with its floor or peer in the same run (interleaved, medians), and
writes the machine it ran on, so that ratios can be trusted on a noisy shared machine.
"""

import os as _os

# Benchmarks start helper processes with ``python -m benchmarks.<module>`` (relays, masters inside network
# namespaces): they find this package wherever they run from.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _ROOT not in _os.environ.get("PYTHONPATH", "").split(_os.pathsep):
    _os.environ["PYTHONPATH"] = _os.pathsep.join(p for p in (_ROOT, _os.environ.get("PYTHONPATH")) if p)
