"""The harness's own check (``tests/unit/test_valgrind.py``): read 64 bytes past the end of a numpy buffer, as a
faulty kernel would. Nothing crashes and nothing is wrong to see from Python; valgrind must report it."""

import ctypes

import numpy as np

a = np.ones(1000, np.float32)
ctypes.string_at(a.ctypes.data, a.nbytes + 64)
print("overread: done")
