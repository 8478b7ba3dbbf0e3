"""Messages of an elastic job's failures, under Horovod's names
(``horovod.runner.elastic.constants``): scripts written for Horovod match on them."""

__all__ = ["RESET_LIMIT_EXCEEDED_MESSAGE", "WORKER_FAILURE_MESSAGE"]

#: Why a job stopped at its ``--reset-limit``; ``{}`` is the limit.
RESET_LIMIT_EXCEEDED_MESSAGE = (
    "Horovod was shutdown because number of resets during elastic job exceeded limit: {}")

#: Why a job that a worker's failure ended stopped. The first sentence is Horovod's, word for
#: word, for the scripts that match on it.
WORKER_FAILURE_MESSAGE = (
    "Horovod detected that one or more processes exited with non-zero status, thus causing the "
    "job to be terminated. The first process to do so was {name}, with {status}.")
