"""Train the digits examples on Spark with ferrovod: the scripts ``ferrovodrun`` runs, unchanged,
one rank per task of a Spark barrier stage (Horovod's ``horovod.spark.run``).

    python examples/spark_digits.py --num-proc 2              # pytorch_digits.py, local Spark
    python examples/spark_digits.py --num-proc 2 --keras      # keras_digits.py (Keras 3 fit)
    spark-submit --files examples/pytorch_digits.py examples/spark_digits.py --num-proc 8

``ferrovod.spark.run`` starts the ranks as tasks that all run at once (a free slot for each, or
it fails after ``--start-timeout`` seconds), each in a fresh Python on its executor with the
environment ``ferrovodrun`` would give it, and returns every rank's result. On a cluster the
script must be on every executor (``--files``, or a shared path).
"""

import argparse
import os
import runpy
import sys
from typing import List

from pyspark.sql import SparkSession

import ferrovod.spark

HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(script: str, argv: List[str]) -> None:
    """Runs ``script`` as ``python script argv...`` would, in this process: the path as given
    where it exists, else the copy ``--files`` put in the executor's working directory."""
    path = script if os.path.exists(script) else os.path.basename(script)
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default=None,
                        help="Spark master (default: spark-submit's, else local[num-proc])")
    parser.add_argument("--num-proc", type=int, default=2, help="ranks")
    parser.add_argument("--start-timeout", type=int, default=600)
    parser.add_argument("--keras", action="store_true",
                        help="keras_digits.py (default: pytorch_digits.py)")
    args, script_args = parser.parse_known_args()

    builder = SparkSession.builder.appName("ferrovod digits")
    # Under spark-submit (which starts this driver through its gateway) its master stands.
    if args.master or "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(args.master or f"local[{args.num_proc}]")
    spark = builder.getOrCreate()
    script = os.path.join(HERE, "keras_digits.py" if args.keras else "pytorch_digits.py")
    ferrovod.spark.run(run_script, args=(script, script_args), num_proc=args.num_proc,
                       start_timeout=args.start_timeout)
    spark.stop()


if __name__ == "__main__":
    main()
