"""Distributed training: the master's synchronous and asynchronous loops (:mod:`.sync`, :mod:`.asynchronous`)
and what runs on the workers (:mod:`.worker`)."""
