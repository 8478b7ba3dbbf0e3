"""Calls ferrovod.init() and prints how it failed: ``INIT-ERROR <class> <seconds> <message>``.

Prints ``INIT-OK`` (and exits 1) if init() succeeds: the test expects the settings it was
given to be refused.
"""

import sys
import time

import ferrovod as fv


def main():
    t0 = time.monotonic()
    try:
        fv.init()
    except Exception as e:  # noqa: BLE001 - the test checks the class
        print(f"INIT-ERROR {type(e).__name__} {time.monotonic() - t0:.3f} {e}", flush=True)
        return
    print("INIT-OK", flush=True)
    sys.exit(1)


if __name__ == "__main__":
    main()
