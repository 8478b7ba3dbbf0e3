"""Imported by every Python process the test suite starts (conftest.py puts this directory on
PYTHONPATH). It changes when the cyclic garbage collector runs, never what the code under test
does; the suite's machine has 2 cores, and they are its bottleneck.

* The youngest generation is collected every 5 000 net allocations instead of Python's default
  700. Importing TensorFlow allocates millions of objects and frees almost none, so at the
  default threshold the collector keeps walking live objects: on the 2-core VM it was a quarter
  of the import's CPU (`import tensorflow`: 3.9 s of user CPU, 3.3 s at this threshold, 3.2 s
  with the collector off; torch 1.8 s, and 1.6-1.7 s with it off).
* At exit, after every other exit handler (this one is registered first, and they run last
  first), every object still alive is frozen (`gc.freeze`): the collections the interpreter
  runs while it tears its modules down then skip them. For a process that imported torch or
  TensorFlow those walks were a fifth to a quarter of its CPU: `import torch` then exit
  1.75 s against 1.39 s, `import tensorflow` 3.55 s against 2.63 s, a 2-rank run of
  examples/pytorch_digits.py 10.8 s against 9.3 s. What the freeze gives up is the collection
  of reference cycles at exit, which Python does not promise (`__del__` of objects alive at
  exit may never run); every module is still torn down and every exit handler, ferrovod's
  shutdown among them, has run. The wheel's test (test_wheel.py) runs its jobs without this
  file, as a user's processes run.
"""

import atexit
import gc

gc.set_threshold(5000, 10, 10)
atexit.register(gc.freeze)
