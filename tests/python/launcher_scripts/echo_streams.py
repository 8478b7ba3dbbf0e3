"""Writes numbered lines to stdout and stderr, then a last stdout line without a newline.

Usage: echo_streams.py LINES
"""

import os
import sys


def main():
    rank = os.environ["FERROVOD_RANK"]
    lines = int(sys.argv[1])
    for i in range(lines):
        # Write each line in two pieces so forwarding must reassemble it.
        sys.stdout.write(f"out rank={rank} i={i} ")
        sys.stdout.flush()
        sys.stdout.write("end\n")
        sys.stderr.write(f"err rank={rank} i={i}\n")
    sys.stdout.write(f"tail rank={rank}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
