"""Prints the rendezvous address it was given, then exits 0 once PATH exists (30 s at most).

Usage: wait_for_file.py PATH
"""

import os
import sys
import time


def main():
    print(f"RENDEZVOUS {os.environ.get('FERROVOD_RENDEZVOUS_ADDR', '')}", flush=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.02)


if __name__ == "__main__":
    main()
