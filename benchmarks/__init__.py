"""Benchmarks: ``python -m benchmarks NAME`` runs one and records its numbers in BENCHMARKS.md.

Every benchmark measures ddlf side by side with its floor or peer in the same run (interleaved, medians), and
writes the machine it ran on, so that ratios can be trusted on a noisy shared machine.
"""
