"""Helpers that Horovod exposes under ``horovod.runner.util`` and that scripts (and Horovod's own
test helpers) import: kept under the same names so that such code moves over unchanged."""
