"""Images per second training a torchvision ResNet on synthetic data, like Horovod's
``pytorch_synthetic_benchmark.py`` (same options and output), with ``ferrovod.torch``.

Run under the launcher, e.g.::

    ferrovodrun -np 2 python examples/pytorch_synthetic_benchmark.py
    ferrovodrun -np 2 python examples/pytorch_synthetic_benchmark.py --model resnet50 \\
        --batch-size 32 --image-size 224 --num-iters 10 --num-batches-per-iter 10

The model is built with random weights (nothing is downloaded) and every step trains on the
same random batch, so the figure is compute plus gradient averaging, free of data loading.
Defaults are sized for a CPU (resnet18, 64x64 images, batch 8); on a GPU machine pass
Horovod's usual ``--image-size 224 --batch-size 32 --model resnet50``. Each iteration times
``--num-batches-per-iter`` steps; the result is the mean over iterations with a 95 %
interval (1.96 standard deviations), per process and in total, as Horovod prints it.

Needs torchvision (``pip install torchvision`` matching the installed torch); without it the
script says so and exits.
"""

from __future__ import annotations

import argparse
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

import ferrovod.torch as hvd


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="PyTorch synthetic benchmark (ferrovod)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--fp16-allreduce", action="store_true", default=False,
                   help="compress gradients to float16 for the allreduce")
    p.add_argument("--model", type=str, default="resnet18",
                   help="torchvision.models constructor name (resnet18, resnet50, ...)")
    p.add_argument("--batch-size", type=int, default=8, help="input batch size per process")
    p.add_argument("--image-size", type=int, default=64, help="height and width of the images")
    p.add_argument("--num-warmup-batches", type=int, default=3,
                   help="number of untimed warm-up batches")
    p.add_argument("--num-batches-per-iter", type=int, default=3,
                   help="number of batches per benchmark iteration")
    p.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
    p.add_argument("--num-threads", type=int, default=0,
                   help="torch intra-op threads per process (0: the machine's cores divided "
                        "by the processes on this host)")
    p.add_argument("--no-cuda", action="store_true", default=False,
                   help="train on the CPU even when CUDA is available")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    hvd.init()
    log = print if hvd.rank() == 0 else (lambda *a, **k: None)

    try:
        from torchvision import models
    except ImportError:
        log("pytorch_synthetic_benchmark.py needs torchvision, which is not installed: "
            "pip install torchvision (the release matching your torch).", file=sys.stderr)
        return 1
    if not callable(getattr(models, args.model, None)):
        log(f"torchvision.models has no model {args.model!r}", file=sys.stderr)
        return 1

    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        torch.backends.cudnn.benchmark = True
    else:
        threads = args.num_threads or max(1, (torch.get_num_threads() or 1) // hvd.local_size())
        torch.set_num_threads(threads)
    device = "GPU" if cuda else "CPU"

    torch.manual_seed(0)
    model = getattr(models, args.model)(weights=None)
    if cuda:
        model.cuda()

    # Horovod's recipe: scale the learning rate by the number of processes.
    optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))
    if cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Image size: {args.image_size}x{args.image_size}")
    log(f"Number of {device}s: {hvd.size()}"
        + ("" if cuda else f" ({torch.get_num_threads()} thread(s) each)"))
    log(f"Gradient allreduce: {'fp16' if args.fp16_allreduce else 'fp32'}")

    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    # Every process's mean, so the total is measured rather than rank 0's figure times n.
    img_sec_mean = float(np.mean(img_secs))
    img_sec_conf = 1.96 * float(np.std(img_secs))
    means = hvd.allgather_object(img_sec_mean, name="synthetic_benchmark.means")
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {sum(means):.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
