"""The torch backend's half of the fast path (compare/harness/fastpath.py) and of `--perturb`
(compare/harness/perturb.py), run by `worker_torch.py` on its launch's ranks. Twin of `fastpath_jax.py`.

`attention`: the attention function the model is given (`torch_impl.parallel.ring_attention_fn` on the job's mesh,
its kernel, the run's ring variant and layout, the merge compiled on GPUs as the points' is) on the fast path's
inputs in bf16, this rank's positions in the ring layout and its fsdp row of the batch; out and the gradients of
<out, dout> for q, k and v gathered to rank 0, which writes them (float32, position order) to `<id>.safetensors`.
`ScaledAttention`: the attention perturbation, a wrapper around such a function; `perturb`: a job's
perturbation applied to a built training.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.numpy import save_file

from compare.harness.fastpath import TENSORS, attention_inputs
from compare.harness.jobs import PERTURBATION, Job, SetupClock, write_result
from compare.harness import perturb as P
from compare.harness.perturb import attention_scaling, weight_scaling
from torch_impl.parallel import make_mesh, ring_attention_fn
from torch_impl.train import Training
from weights import open_weights
from weights.layout import rank_positions
from weights.parallel import RING_LAYOUT


class _ScaledGradient(torch.autograd.Function):
    """The identity whose backward scales the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class ScaledAttention(P.ScaledAttention):
    """The attention perturbation in torch (`compare.harness.perturb.ScaledAttention`)."""

    constant = staticmethod(torch.Tensor.detach)
    scaled_gradient = staticmethod(_ScaledGradient.apply)


def perturb(run: Training, value: str | None) -> None:
    """A job's perturbation (`Job.perturb`) on a built training: one weight scaled, or its attention wrapped."""
    name, scaling = weight_scaling(value), attention_scaling(value)
    if name is not None:
        with torch.no_grad():
            dict(run.llama.named_parameters())[name].to_local().mul_(1 + PERTURBATION)
    if scaling is not None:
        run.llama.attention_fn = ScaledAttention(*scaling)(run.llama.attention_fn)


def attention(job: Job, work_dir: Path, device: torch.device, clock: SetupClock) -> None:
    """An "attention" job (module docstring)."""
    settings = job.settings()
    config = open_weights(job.model, job.seed).config
    mesh = make_mesh(settings.mesh, device.type)
    fn = ring_attention_fn(mesh, backend=job.attention_backend, variant=settings.ring_variant,
                           compile_merge=device.type == "cuda")
    scaling = attention_scaling(job.perturb)
    if scaling is not None:
        fn = ScaledAttention(*scaling)(fn)
    inputs = attention_inputs(settings.batch, job.seq_len, config.num_heads, config.num_kv_heads, config.head_dim)
    clock.weights_loaded()
    sp = settings.mesh.sp
    row, positions = mesh.get_local_rank("fsdp"), rank_positions(job.seq_len, sp, mesh.get_local_rank("sp"),
                                                                  RING_LAYOUT)

    def local(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array[row:row + 1, positions])).to(device, torch.bfloat16)

    q, k, v = (local(inputs[name]).requires_grad_() for name in ("q", "k", "v"))
    out = fn(q, k, v)
    out.backward(local(inputs["dout"]))
    results = dict(zip(TENSORS, (out.detach(), q.grad, k.grad, v.grad)))
    grid = settings.mesh.rank_grid()
    gathered = {}
    for name, value in results.items():
        parts = [torch.empty_like(value, dtype=torch.float32) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, value.float().contiguous())
        if dist.get_rank() == 0:
            whole = np.zeros((settings.batch, job.seq_len, *value.shape[2:]), dtype=np.float32)
            for rank, part in enumerate(parts):
                f, s = (int(i[0]) for i in np.nonzero(grid == rank))
                whole[f, rank_positions(job.seq_len, sp, s, RING_LAYOUT)] = part[0].cpu().numpy()
            gathered[name] = whole
    if dist.get_rank() == 0:
        save_file(gathered, str(work_dir / f"{job.id}.safetensors"))
        write_result(work_dir, job, {"status": "ok", "setup": clock.result()})
