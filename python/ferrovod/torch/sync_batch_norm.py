"""``SyncBatchNorm``: batch normalization whose batch statistics span every rank's batch.

Unlike Horovod's (CUDA only, built on ``torch.batch_norm_stats``), this one is written in
plain torch ops, so it runs on CPU and on any device. Training forward allreduces one small
tensor per call (per-channel sum, sum of squares and count, in float64 so the one-pass
variance stays accurate); backward allreduces the per-channel sums of ``dy`` and
``dy * x_hat``. The weight and bias gradients are this rank's own contributions: the
``DistributedOptimizer`` averages them like any other gradient. The result equals
``BatchNorm`` applied to the concatenation of every rank's batch.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..process_sets import ProcessSet, global_process_set
from . import ops
from .._api import Sum

__all__ = ["SyncBatchNorm"]


def _channel_view(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view((1, -1) + (1,) * (x.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], running_mean: Optional[torch.Tensor],
                running_var: Optional[torch.Tensor], eps: float, momentum: float,
                process_set: ProcessSet) -> torch.Tensor:
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xd = x.detach().double()
        local = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                           torch.tensor([x.numel() // max(c, 1)], dtype=torch.float64,
                                        device=x.device)])
        stats = ops.synchronize(ops.allreduce_async_(local, op=Sum, process_set=process_set,
                                                     name=None))
        n = float(stats[-1])
        if n <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {list(x.shape)} (summed over the process set: {int(n)})")
        mean = stats[:c] / n
        var = (stats[c:2 * c] / n - mean * mean).clamp_(min=0.0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_((var * (n / (n - 1))).to(running_var.dtype),
                                                    alpha=momentum)
        x_hat = (x - _channel_view(mean.to(x.dtype), x)) * _channel_view(invstd.to(x.dtype), x)
        out = x_hat
        if weight is not None:
            out = out * _channel_view(weight, x)
        if bias is not None:
            out = out + _channel_view(bias, x)
        ctx.save_for_backward(x_hat, invstd.to(x.dtype), weight)
        ctx.n, ctx.process_set, ctx.has_bias = n, process_set, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        x_hat, invstd, weight = ctx.saved_tensors
        c = x_hat.shape[1]
        dims = [0] + list(range(2, x_hat.dim()))
        sum_dy = grad.sum(dims)
        sum_dy_xhat = (grad * x_hat).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xhat]).double()
            both = ops.synchronize(ops.allreduce_async_(both, op=Sum, process_set=ctx.process_set))
            mean_dy = (both[:c] / ctx.n).to(grad.dtype)
            mean_dy_xhat = (both[c:] / ctx.n).to(grad.dtype)
            scale = invstd if weight is None else invstd * weight
            grad_input = (grad - _channel_view(mean_dy, grad)
                          - x_hat * _channel_view(mean_dy_xhat, grad)) * _channel_view(scale, grad)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over every rank's batch (any input of shape ``(N, C, ...)``).

    Arguments as ``torch.nn.BatchNorm*d``; ``process_set`` limits the statistics to a subset
    of ranks. In eval mode (with running statistics), or in a set of one rank, it is plain
    batch normalization.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalizes ``input`` with statistics gathered from every rank (training)."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None
        if not bn_training or not self.process_set.included() or len(self.process_set.ranks) <= 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor, self.process_set)
