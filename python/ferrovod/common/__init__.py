"""``ferrovod.common``: the framework-free helpers a Horovod script may import from
``horovod.common`` (``horovod.common.util``, ``.exceptions``, ``.process_sets``), so that
``from horovod.common.X import Y`` moves over as ``from ferrovod.common.X import Y``."""
