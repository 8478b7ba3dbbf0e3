"""``python -m ferrovod.runner``: the same as ``ferrovodrun``."""

from .launch import main

if __name__ == "__main__":
    main()
