"""Train the digits examples on a Ray cluster with ferrovod: the scripts ``ferrovodrun`` runs,
unchanged.

    python examples/ray_digits.py --workers 2                 # pytorch_digits.py, RayExecutor
    python examples/ray_digits.py --workers 2 --keras         # keras_digits.py (Keras 3 fit)
                                                              # inside Ray Train's TensorflowTrainer
    python examples/ray_digits.py --address auto --workers 8  # on a running cluster

With ``ferrovod.ray.RayExecutor`` (Horovod's ``horovod.ray`` API) every rank is a Ray actor; the
executor reserves the ranks' CPUs in one placement group and gives each the environment
``ferrovodrun`` would. With ``--keras`` the ranks are the workers of Ray Train's own
``TensorflowTrainer``: ferrovod needs nothing but the ``TF_CONFIG`` the trainer sets, and Keras 3
gets the multi-worker ``fit`` that TensorFlow's own strategy does not give it. Ray ships this
directory to every node (``runtime_env`` ``working_dir``) and puts it on the workers' path.
"""

import argparse
import os
import runpy
import sys
from typing import List

import ray

HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(module: str, argv: List[str]) -> None:
    """Runs ``<module>.py`` as ``python <module>.py argv...`` would, in this process. Ray puts
    this directory on every worker's ``sys.path`` (its working directory may be another:
    Ray Train moves it)."""
    sys.argv = [f"{module}.py", *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def keras_worker(config: dict) -> None:
    run_script(config["module"], config["argv"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join (default: start a local one)")
    parser.add_argument("--workers", type=int, default=2, help="ranks")
    parser.add_argument("--cpus-per-worker", type=int, default=1)
    parser.add_argument("--keras", action="store_true",
                        help="keras_digits.py inside TensorflowTrainer (default: pytorch_digits.py "
                             "on RayExecutor)")
    args, script_args = parser.parse_known_args()

    ray.init(address=args.address, runtime_env={"working_dir": HERE})
    if args.keras:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.tensorflow import TensorflowTrainer

        trainer = TensorflowTrainer(
            keras_worker,
            train_loop_config={"module": "keras_digits", "argv": script_args},
            scaling_config=ScalingConfig(num_workers=args.workers,
                                         resources_per_worker={"CPU": args.cpus_per_worker}),
            run_config=RunConfig(name="ferrovod_keras_digits"),
        )
        trainer.fit()
    else:
        from ferrovod.ray import RayExecutor

        executor = RayExecutor(RayExecutor.create_settings(timeout_s=120),
                               num_workers=args.workers, cpus_per_worker=args.cpus_per_worker)
        executor.start()
        try:
            executor.run(run_script, args=["pytorch_digits", script_args])
        finally:
            executor.shutdown()


if __name__ == "__main__":
    main()
