"""Distributed Llama training for the PyTorch backend: the sequence-sharded next-token loss, AdamW with global
grad-norm clipping, the train step and the training loop. Twin of `jax_impl/train.py`. Mesh, FSDP2 and the data
split are `torch_impl/parallel.py`; checkpoints and weight export are `torch_impl/checkpointing.py`; the
`twinflash train` command that builds the batches and reports the steps is `compare/commands/train.py`.

Numerics both backends follow, so that their per-step losses agree (fp32):
  loss       sum of next-token cross-entropy over the valid target positions of the whole global batch, divided by
             their global count. Each rank sums over its own tokens and divides by the global count; the ranks'
             gradients are then summed (FSDP set to a plain sum), which is the gradient of that global mean. The
             logits are made chunk by chunk of the rank's sequence-sharded hidden states (`loss_chunk_tokens`
             rows at a time), so neither the full [S, V] nor the local [S_local, V] logits ever exist at once,
             and recomputed in the backward; on GPUs each chunk's gradients are made in the forward instead
             (`fused_cross_entropy_mean`, the same loss to rounding, no logits recomputed).
  clipping   global L2 norm of all gradients (sqrt of the all-reduced sum of squares of the local shards);
             every gradient is multiplied by min(1, max_norm / (norm + 1e-6)), torch's clip_grad_norm_ formula.
  AdamW      torch.optim.AdamW semantics: p *= 1 - lr * wd (2-D parameters only) before the Adam update;
             m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t)
             + eps) with t = step + 1; lr = OptimizerConfig.learning_rate(step), set every step; fp32 state.
  precision  fp32 master weights and optimizer state; with bf16, FSDP gathers bf16 weights for the compute and
             reduces fp32 gradients (MixedPrecisionPolicy). With fp8 (bf16 only) the decoder layers' linears are
             torchao Float8Linears (`convert_to_fp8`, weights/fp8.py's recipe), converted before FSDP wraps them.
  documents  with `settings.pack` no target crosses a document's end, RoPE positions restart at each document and
             the attention runs on the segment ids (`local_packed_batch`) in the scheme's layout (`scheme_layout`:
             the ring's PACKED_RING_LAYOUT; RING_LAYOUT for Ulysses and hybrid).

Speed on GPUs (`--eager` turns the first three off): the modules around the attention, the ring's merge and the
loss chunks run under torch.compile, the loss makes its gradients in the forward (`fused_cross_entropy_mean`),
AdamW runs as torch's fused kernel (same formula, `AdamW`), and the loop never waits for a step inside it
(`StepNumbers`).
`twinflash train --profile` traces the last steps (`torch_impl/profiling.py`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from torch_impl import checkpointing
from torch_impl.attention import AttentionFn
from torch_impl.model import DTYPES, Llama, convert_to_fp8
from torch_impl.parallel import (load_local_shards, local_batch, local_packed_batch, make_mesh, sequence_parallel_fn,
                                 shard_model)
from torch_impl.profiling import StepProfiler, region
from weights import ConvertedCheckpoint, RandomWeights, open_weights
from weights.fp8 import fallback_line, fp8_linears
from weights.parallel import checkpointed_layers, scheme_layout
from weights.profiling import profiled_steps
from weights.schedule import OptimizerConfig
from weights.settings import TrainSettings
from weights.checkpoint_integrity import set_aside
from weights.training import (IGNORE_INDEX, adamw_coefficients, check_attention_backend, check_batches,
                              check_step_finite, checkpoint_due, checkpoint_to_resume, default_loss_chunk_tokens,
                              host_peak_rss_bytes, print_to_stderr, run_metadata, valid_target_count)


def _chunk_cross_entropy_sum(llama: Llama, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(llama.logits(hidden), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def cross_entropy_sum(llama: Llama, hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                      chunk_loss: Callable = _chunk_cross_entropy_sum) -> torch.Tensor:
    """float32 sum of next-token cross-entropy over the positions of `hidden` [B, S, hidden] whose target is not
    IGNORE_INDEX, `chunk_tokens` positions at a time, each chunk's logits recomputed in the backward;
    `chunk_loss` is `_chunk_cross_entropy_sum` or a compiled copy of it."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total = total + checkpoint(chunk_loss, llama, hidden[rows], targets[rows], use_reentrant=False)
    return total


def chunk_loss_and_gradient(logits: torch.Tensor, targets: torch.Tensor, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(`scale` x the float32 sum of cross-entropy over the rows of `logits` [rows, vocab] whose target is not
    IGNORE_INDEX, its gradient w.r.t. `logits` in their dtype): softmax minus the one-hot target, in float32."""
    logits32 = logits.float()
    lse = torch.logsumexp(logits32, dim=-1)
    valid = targets != IGNORE_INDEX
    picked_class = torch.where(valid, targets, 0)
    picked = logits32.gather(1, picked_class[:, None])[:, 0]
    loss = torch.where(valid, lse - picked, 0.0).sum() * scale
    one_hot = torch.arange(logits.shape[-1], device=logits.device) == picked_class[:, None]
    gradient = (torch.exp(logits32 - lse[:, None]) - one_hot.float()) * scale
    return loss, torch.where(valid[:, None], gradient, 0.0).to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """`scale` x the cross-entropy sum of the logits `hidden @ head^T`, chunk by chunk, each chunk's gradients made
    in the forward (the loss ends the graph, so its gradient is known there: the backward only scales them by the
    incoming gradient, 1 for `loss.backward()`), so no chunk's logits are made twice."""

    @staticmethod
    def forward(ctx, hidden, head, targets, chunk_tokens: int, scale: float, chunk_fn):
        d_hidden = torch.empty_like(hidden)
        d_head = torch.zeros_like(head)  # summed over chunks in head's dtype, as autograd sums the chunks' grads
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            loss, d_logits = chunk_fn(F.linear(hidden[rows], head), targets[rows], scale)
            total += loss
            torch.mm(d_logits, head, out=d_hidden[rows])
            d_head.addmm_(d_logits.t(), hidden[rows])
        ctx.save_for_backward(d_hidden, d_head)
        return total

    @staticmethod
    def backward(ctx, grad):
        d_hidden, d_head = ctx.saved_tensors
        return d_hidden * grad, d_head * grad, None, None, None, None


def fused_cross_entropy_mean(hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                             divisor: int, chunk_fn: Callable = chunk_loss_and_gradient) -> torch.Tensor:
    """The float32 sum of next-token cross-entropy of `hidden` [B, S, hidden] against `targets` [B, S]
    (IGNORE_INDEX skipped) divided by `divisor`, the logits made `chunk_tokens` positions at a time with the LM
    head `head` [vocab, hidden] and never recomputed: the same loss and gradients as `cross_entropy_sum` /
    divisor, to rounding, with one logits matmul per chunk less. `chunk_fn` is `chunk_loss_and_gradient` or a
    compiled copy of it."""
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), head, targets.reshape(-1), chunk_tokens,
                                     1.0 / divisor, chunk_fn)


class ShardedNextTokenLoss(nn.Module):
    """The FSDP root: this rank's share of the global mean next-token loss (its cross-entropy sum over the global
    count of valid targets). Holding the model as a child lets the root's FSDP hooks gather the LM head that the
    loss uses outside `Llama.forward`. `fused`: the loss and its gradients in one pass over each chunk's logits
    (`fused_cross_entropy_mean`, what the training step runs on GPUs), else `cross_entropy_sum` (the logits
    recomputed in the backward by autograd: the matched numerics the equivalence tests hold the JAX twin to)."""

    def __init__(self, llama: Llama, chunk_tokens: int, fused: bool = False):
        super().__init__()
        self.llama = llama
        self.chunk_tokens = chunk_tokens
        self.fused = fused
        self.chunk_fn = chunk_loss_and_gradient if fused else _chunk_cross_entropy_sum

    def compile_loss(self) -> None:
        """torch.compile each chunk's cross-entropy (and in the fused loss its gradient): the float32 cast,
        log-softmax and pick fuse into reductions over the logits instead of several passes over a float32
        [chunk, vocab] copy."""
        self.chunk_fn = torch.compile(self.chunk_fn)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                global_valid_count: int, with_logits: bool = False, segment_ids: torch.Tensor | None = None):
        """The loss share; with `with_logits`, (loss share, this rank's float32 logits [B, S_local, vocab], made
        without autograd) for checks on short sequences. `segment_ids`: packed documents, for the attention."""
        hidden = self.llama.hidden_states(tokens, positions, segment_ids)
        with region("loss"):
            if self.fused:
                loss = fused_cross_entropy_mean(hidden, self.llama.head_weight(), targets, self.chunk_tokens,
                                                global_valid_count, self.chunk_fn)
            else:
                total = cross_entropy_sum(self.llama, hidden, targets, self.chunk_tokens, self.chunk_fn)
                loss = total / global_valid_count
        if not with_logits:
            return loss
        with torch.no_grad():
            return loss, self.llama.logits(hidden).float()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is its own shard)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global grad norm over all ranks' shards; scales the gradients in place by min(1, max_norm / (norm + 1e-6))
    (torch's formula). Returns the norm before clipping, a 0-d float32 tensor on the device (reading it on the
    host would stall the step until the backward is done)."""
    grads = [_local(p.grad) for p in parameters]
    squares = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(squares)
    norm = squares.sqrt()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


class AdamW:
    """AdamW over (possibly sharded) parameters, torch.optim.AdamW's arithmetic (module docstring), weight decay
    on 2-D parameters only. State: float32 `exp_avg` and `exp_avg_sq` per parameter, sharded like it.

    Two implementations of that arithmetic: `fused=False` writes it out op by op with foreach kernels (about ten
    passes over the state; the reference the equivalence tests hold the JAX twin to); `fused=True` runs torch's
    fused AdamW kernel (`torch._fused_adamw_`, what `torch.optim.AdamW(fused=True)` calls: the same formula in one
    pass per parameter group), which agrees with the written-out one to float32 rounding
    (tests/test_profile.py)."""

    def __init__(self, named_parameters: dict[str, nn.Parameter], config: OptimizerConfig, fused: bool = False):
        self.parameters = named_parameters
        self.config = config
        self.fused = fused
        self.exp_avg = {name: torch.zeros_like(p) for name, p in named_parameters.items()}
        self.exp_avg_sq = {name: torch.zeros_like(p) for name, p in named_parameters.items()}

    @torch.no_grad()
    def step(self, coefficients: dict[str, float], step: int) -> None:
        """Applies optimizer step `step` (0-based) to the parameters' gradients; `coefficients` are its host
        scalars (`weights.training.adamw_coefficients`)."""
        c = self.config
        names = list(self.parameters)
        params = [_local(self.parameters[n]) for n in names]
        grads = [_local(self.parameters[n].grad) for n in names]
        exp_avg = [_local(self.exp_avg[n]) for n in names]
        exp_avg_sq = [_local(self.exp_avg_sq[n]) for n in names]
        if self.fused:
            self._fused_step(names, params, grads, exp_avg, exp_avg_sq, coefficients["lr"], step)
            return
        decayed = [p for n, p in zip(names, params) if self.parameters[n].ndim == 2]
        torch._foreach_mul_(decayed, coefficients["decay"])
        torch._foreach_lerp_(exp_avg, grads, 1 - c.beta1)
        torch._foreach_mul_(exp_avg_sq, c.beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - c.beta2)
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, coefficients["bias_correction2_sqrt"])
        torch._foreach_add_(denom, c.eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, value=-coefficients["step_size"])

    def _fused_step(self, names, params, grads, exp_avg, exp_avg_sq, lr: float, step: int) -> None:
        c = self.config
        # The kernel reads t from a tensor per parameter; one shared tensor, filled without a host sync.
        t = torch.full((), float(step + 1), dtype=torch.float32, device=params[0].device)
        for decay, wanted in ((c.weight_decay, True), (0.0, False)):  # weight decay on 2-D parameters only
            group = [i for i, n in enumerate(names) if (self.parameters[n].ndim == 2) == wanted]
            if group:
                torch._fused_adamw_([params[i] for i in group], [grads[i] for i in group],
                                    [exp_avg[i] for i in group], [exp_avg_sq[i] for i in group], [],
                                    [t] * len(group), lr=lr, beta1=c.beta1, beta2=c.beta2, weight_decay=decay,
                                    eps=c.eps, amsgrad=False, maximize=False)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The state tensors themselves (loading into them with DCP restores the optimizer in place)."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return host_peak_rss_bytes()


def all_ranks(value: int, device: torch.device) -> list[int]:
    """`value` of every rank, in rank order."""
    local = torch.tensor([value], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, local)
    return [int(t) for t in everyone]


def init_distributed(timeout_s: float | None = None) -> torch.device:
    """Joins the torchrun-launched process group (NCCL on GPUs, gloo on CPU); returns this rank's device.
    `timeout_s` bounds every collective's wait for the other ranks (a run spanning nodes: a node that died ends
    the others' collectives with an error instead of a hang); None keeps torch's default. Twin of the JAX
    `init_distributed`, which joins the processes of a run spanning nodes."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None,
                                timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s))
    return device


def launch_step(model: ShardedNextTokenLoss, optimizer: AdamW, tokens: torch.Tensor, targets: torch.Tensor,
                positions: torch.Tensor, step: int, global_valid_count: int, skip_non_finite: bool = False,
                segment_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Queues one optimizer step on this rank's part of a global batch without waiting for it: (global mean loss,
    grad norm before clipping: 0-d float32 device tensors, learning rate). With `skip_non_finite` it waits for the
    loss and grad norm, and applies no update when either is not finite (--skip-non-finite-steps)."""
    config = optimizer.config
    loss = model(tokens, positions, targets, global_valid_count, segment_ids=segment_ids)
    loss.backward()
    global_loss = loss.detach()
    dist.all_reduce(global_loss)  # each rank's share of the global mean
    with region("optimizer"):
        grad_norm = clip_grad_norm_(list(optimizer.parameters.values()), config.grad_clip_norm)
        coefficients = adamw_coefficients(config, step)
        # every rank holds the same global loss and norm, so all of them skip or none
        if not skip_non_finite or bool(torch.isfinite(global_loss) & torch.isfinite(grad_norm)):
            optimizer.step(coefficients, step)
    for p in optimizer.parameters.values():
        p.grad = None
    return global_loss, grad_norm, coefficients["lr"]


def train_step(model: ShardedNextTokenLoss, optimizer: AdamW, tokens: torch.Tensor, targets: torch.Tensor,
               positions: torch.Tensor, step: int, global_valid_count: int) -> tuple[float, float, float]:
    """One optimizer step on this rank's part of a global batch, waited for: (global mean loss, grad norm before
    clipping, learning rate)."""
    loss, grad_norm, lr = launch_step(model, optimizer, tokens, targets, positions, step, global_valid_count)
    loss_value, grad_norm_value = torch.stack([loss, grad_norm]).tolist()
    return loss_value, grad_norm_value, lr


class StepNumbers:
    """What the loop reports of a launched step, on its way to the host without stalling the device: the loss, the
    grad norm and every rank's peak memory, gathered into one device tensor whose copy to (pinned) host memory is
    queued behind the step. `read()` waits for that copy only."""

    def __init__(self, loss: torch.Tensor, grad_norm: torch.Tensor, device: torch.device):
        # the allocator's peak is known on the host once the step is queued (allocation happens at launch)
        peak = torch.tensor([float(peak_memory_bytes(device))], dtype=torch.float64)
        if device.type == "cuda":
            peak = peak.pin_memory().to(device, non_blocking=True)
        local = torch.cat([torch.stack([loss, grad_norm]).double(), peak])
        everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, local)
        self.host = torch.stack(everyone).to("cpu", non_blocking=device.type == "cuda")
        self.done = completion_mark(device)

    def read(self) -> tuple[float, float, list[int]]:
        """(loss, grad norm, peak memory bytes per rank), once the step is done."""
        if isinstance(self.done, torch.cuda.Event):
            self.done.synchronize()
        rows = self.host.tolist()
        return rows[0][0], rows[0][1], [int(row[2]) for row in rows]


def completion_mark(device: torch.device) -> torch.cuda.Event | float:
    """A point in the device's work queue: a timed CUDA event recorded behind the work queued so far, or, where
    work runs synchronously (CPU), the host clock now."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(earlier: torch.cuda.Event | float, later: torch.cuda.Event | float) -> float:
    """Time between two completion marks (CUDA events: on the device's clock, once `later` has completed)."""
    if isinstance(later, torch.cuda.Event):
        return earlier.elapsed_time(later) / 1e3
    return later - earlier


StepCallback = Callable[..., None]
ProfileCallback = Callable[[dict], None]




def run_training(settings: TrainSettings, batches: np.ndarray, on_step: StepCallback | None = None,
                 on_profile: ProfileCallback | None = None, segment_ids: np.ndarray | None = None) -> None:
    """Trains `settings.model` on `batches` (int64 [steps, batch, seq_len], the global batches, the same on every
    rank) under torchrun, with `settings.pack` on the packed documents of `segment_ids` (like the batches:
    `weights.data.training_segment_ids`); see `weights.settings.TrainSettings` for the fields read here. On rank 0,
    `on_step(step=, loss=, lr=, grad_norm=, seconds=, peak_memory_bytes=[per rank])` after every step. Resumes
    from the latest checkpoint with `settings.resume`, saves every `settings.ckpt_every` steps and at the end of
    the run, exports the final weights to `settings.export_paths` when set. With `settings.profile`, rank 0
    traces the last steps (`weights.profiling.profiled_steps`) and calls `on_profile(breakdown)` at the end
    (`weights.profiling.breakdown`, plus "device"). A step with a non-finite loss or grad norm stops the run
    before any checkpoint holds it (NonFiniteStepError), or with `settings.skip_non_finite_steps` is not applied."""
    device = init_distributed()
    try:
        _train(settings, batches, on_step, on_profile, device, segment_ids)
    finally:
        dist.destroy_process_group()


@dataclasses.dataclass
class Training:
    """A model ready to train on this rank: the mesh, the sharded `llama` inside its loss root `model`, the
    optimizer, the weights it was loaded from and the run metadata its checkpoints record."""

    mesh: DeviceMesh
    llama: Llama
    model: ShardedNextTokenLoss
    optimizer: AdamW
    source: ConvertedCheckpoint | RandomWeights
    meta: dict
    device: torch.device


def build_training(settings: TrainSettings, device: torch.device, attention: AttentionFn | None = None) -> Training:
    """The sharded model and optimizer of `settings` on the initialised process group (`init_distributed`), its
    weights loaded from `settings.model`; no checkpoint read, nothing trained. `attention`: the model's attention
    function (None: the settings' sequence-parallel scheme over the mesh's sp ranks; `twinflash bench train-peer`
    passes PyTorch's context parallelism)."""
    check_attention_backend(settings)
    mesh = make_mesh(settings.mesh, device.type)
    source = open_weights(settings.model, settings.seed)
    config = source.config
    fast = device.type == "cuda" and not settings.eager  # inductor and fused kernels: GPUs only
    if attention is None:
        attention = sequence_parallel_fn(mesh, settings.sp_scheme, settings.ulysses_degree,  # the sp ranks together
                                         backend=settings.attention_backend, variant=settings.ring_variant,
                                         compile_merge=fast, layout=scheme_layout(settings.sp_scheme, settings.pack))
    with torch.device("meta"):
        llama = Llama(config, attention)
    if settings.fp8:  # before FSDP, which then shards and gathers the Float8Linears' plain weights
        convert_to_fp8(llama, fp8_linears(config)[0], emulate=device.type != "cuda")
        if dist.get_rank() == 0 and fallback_line(config) is not None:
            print_to_stderr(fallback_line(config))
    chunk_tokens = settings.loss_chunk_tokens or default_loss_chunk_tokens(config.vocab_size)
    model = ShardedNextTokenLoss(llama, chunk_tokens, fused=fast)
    shard_model(model, llama, mesh, compute_dtype=DTYPES[settings.dtype], remat=settings.activation_checkpointing,
                checkpointed=checkpointed_layers(settings.activation_checkpointing, config.num_layers,
                                                 settings.checkpointed_layers))
    load_local_shards(llama, source, device)
    if fast:
        llama.compile_elementwise()
        model.compile_loss()
    optimizer = AdamW(dict(llama.named_parameters()), settings.optimizer, fused=fast)
    return Training(mesh, llama, model, optimizer, source, run_metadata(settings, config), device)


def _train(settings, batches: np.ndarray, on_step: StepCallback | None, on_profile: ProfileCallback | None,
           device: torch.device, segment_ids: np.ndarray | None) -> None:
    check_batches(settings, batches, segment_ids)
    run = build_training(settings, device)
    mesh, llama, model, optimizer, meta = run.mesh, run.llama, run.model, run.optimizer, run.meta

    # Rank 0 verifies the checkpoints' checksums (one pass over the files, not one per rank) and every rank resumes
    # from what it found.
    resume = [checkpoint_to_resume(settings, meta, checkpointing.completed_checkpoints, checkpointing.read_metadata,
                                   warn=print_to_stderr) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(resume, src=0)
    latest, start, passed_over = resume[0]
    if dist.get_rank() == 0:
        set_aside(list(passed_over))
    if latest is not None:
        checkpointing.load_checkpoint(latest, llama, optimizer.state_dict())
        if dist.get_rank() == 0:
            print(f"resumed from {latest} (step {start})", flush=True)

    stop = settings.stop_at or batches.shape[0]
    traced = settings.profile and dist.get_rank() == 0
    profiler = StepProfiler(device, profiled_steps(start, stop) if traced else range(0))
    # No host synchronisation inside the loop: step N's numbers are read once step N + 1 is queued, so the host
    # prepares and launches the next step while the device runs this one. A step's time is the device's time
    # between the completions of its predecessor and itself (CUDA events). The host clock would misplace it: a
    # launch that blocks the host (the allocator, a collective's set-up) shifts time from one step to the next, as
    # seen on 2 H200s, where a 3 s step read 3.1 s and the next 0.1 s.
    pending: tuple[int, StepNumbers, float] | None = None
    last_done = completion_mark(device)

    def report(step: int, numbers: StepNumbers, lr: float) -> None:
        nonlocal last_done
        loss, grad_norm, peaks = numbers.read()
        if on_step is not None and dist.get_rank() == 0:
            on_step(step=step, loss=loss, lr=lr, grad_norm=grad_norm, seconds=seconds_between(last_done, numbers.done),
                    peak_memory_bytes=peaks)
        last_done = numbers.done
        # every rank reads the same gathered numbers, so every rank stops at the same step
        skipped = check_step_finite(settings, step, loss, grad_norm, latest)
        if skipped is not None and dist.get_rank() == 0:
            print_to_stderr(skipped)

    for step in range(start, stop):
        profiler.begin(step)
        if segment_ids is None:
            loss, grad_norm, lr = launch_step(model, optimizer, *local_batch(batches[step], mesh, device), step,
                                              valid_target_count(settings.batch, settings.seq_len),
                                              settings.skip_non_finite_steps)
        else:
            tokens, targets, positions, ids = local_packed_batch(batches[step], segment_ids[step], mesh, device,
                                                                 scheme_layout(settings.sp_scheme, True))
            loss, grad_norm, lr = launch_step(model, optimizer, tokens, targets, positions, step,
                                              valid_target_count(settings.batch, settings.seq_len, segment_ids[step]),
                                              settings.skip_non_finite_steps, segment_ids=ids)
        numbers = StepNumbers(loss, grad_norm, device)
        if pending is not None:
            report(*pending)
        profiler.end(step)  # a traced step is waited for here
        pending = (step, numbers, lr)
        if checkpoint_due(settings, step + 1, stop):  # queued behind this step, before the next one changes it
            report(*pending)  # a checkpoint holds only steps seen to be finite
            pending = None
            latest = checkpointing.save_checkpoint(settings.ckpt_dir, step + 1, llama, optimizer.state_dict(),
                                                   meta, keep=settings.keep)
    if pending is not None:
        report(*pending)
    if traced and on_profile is not None:
        on_profile(profiler.breakdown())
    if settings.export_paths is not None:
        checkpointing.export_trained_weights(llama, *settings.export_paths, run.source)
