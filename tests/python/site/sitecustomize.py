"""Imported by every Python process the test suite starts (conftest.py puts this directory on
PYTHONPATH): the cyclic garbage collector collects its youngest generation every 5 000 net
allocations instead of Python's default 700.

Importing TensorFlow allocates millions of objects and frees almost none, so at the default
threshold the collector keeps walking live objects: on the 2-core VM it was a quarter of the
import's CPU (`import tensorflow`: 3.9 s of user CPU, 3.3 s at this threshold, 3.2 s with the
collector off; torch 1.8 s, and 1.6-1.7 s with it off). The suite starts about 70 TensorFlow processes on a machine whose cores are its
bottleneck. Collection still runs, over the same generations, only less often; the code under
test depends on no collection's timing.
"""

import gc

gc.set_threshold(5000, 10, 10)
