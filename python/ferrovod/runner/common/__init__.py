"""Launcher helpers under Horovod's module names (``horovod.runner.common``)."""
