"""`twinflash check`: the fast path of `twinflash compare` (compare/harness/fastpath.py) for one backend on a mesh of
the user's, so that someone who changed a kernel can prove it in a minute: the model's attention function with our
kernels and with the vendor's (off-GPU the plain-math reference), bf16, on random inputs at the model's head shapes,
against float64 attention; and one bf16 training step with each, every parameter's gradient distance to the
float32 step's, ours within 2x the vendor's. A standalone command rather than `compare --no-bench`, which takes
meshes of one sequence over all devices only (fsdp=1), always runs both backends' float32 checks (torch's float32
reference among them: the whole model in float32, minutes on a large model) and a check at every device count.

Here one launch of the backend (torchrun or one JAX process) over the mesh's devices runs five jobs: the float32
step with the plain-math attention on the same mesh (its ring in float32 math, held to single-device float32 by
the ring tests), then the attention and the bf16 step with each kernel. `--mesh fsdp=A,sp=B`: A sequences, one per
fsdp row, each split over B devices in the ring. Prints the verdict and one line per failing rule, writes
OUT/check.json (the report's fast-path section, compare/report/schema.json's `fast_path`) and OUT/check.md; exit 0
when every rule holds, 1 when one fails (or a job failed), 2 for bad input.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
from pathlib import Path

from compare.args import integer, number
from compare.harness import jobs as J
from compare.harness import perturb as P
from compare.harness.fastpath import fast_path_section
from compare.harness.launches import run_launch, side_launcher
from compare.harness.plan import (CPU_DEFAULTS, GPU_DEFAULTS, MAX_CHECK_SEQ_LEN, WEIGHTS_DIR, default_check_layers,
                                  fast_path_jobs, first_layers, gpu_count, prepared_weights)
from compare.launch import Interrupted, interruptible
from compare.report import fastpath as fast_path_report
from compare.report.render import markdown
from weights import PRESETS, BadInputError, open_weights, parameter_shapes
from weights.atomic import check_output_dir, write_text_atomically
from weights.errors import EXIT_CHECK_FAILED, EXIT_OK
from weights.layout import check_split
from weights.parallel import RING_LAYOUT, MeshShape
from weights.training import BACKENDS

CPU_SP = 2  # the default mesh off-GPU: sp=2, the ring in play at the cost of two emulated devices
HELP = ("the fast path for one backend on a mesh: our attention kernels and a bf16 step against the vendor's and exact "
        "answers (a minute after a kernel change)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--model", default="tiny", help=f"converted checkpoint dir or preset ({', '.join(PRESETS)})")
    parser.add_argument("--mesh", help=f"e.g. fsdp=2,sp=2 (default: sp over all GPUs; sp={CPU_SP} on CPU)")
    parser.add_argument("--seq-len", type=integer(2), help="tokens per sequence (default "
                        f"{min(GPU_DEFAULTS['seq_lens'][0], MAX_CHECK_SEQ_LEN)} on GPUs, "
                        f"{CPU_DEFAULTS['seq_lens'][0]} on CPU: the compare check's)")
    parser.add_argument("--layers", type=integer(1), help="the model's first N layers (default: all, or 2 above 2B "
                        "parameters)")
    parser.add_argument("--perturb", metavar="BACKEND:attention-T=F", help="negative control: one output of our "
                        "attention (T: out, dq, dk, dv) scaled by F; the check must fail naming it")
    parser.add_argument("--job-timeout-s", type=number(0, above=True), default=900.0,
                        help="a job silent this long is stopped")
    parser.add_argument("--out", type=Path, help="must not exist or be empty (default: out/check-<backend>-<time>)")


def _settings(args: argparse.Namespace, gpus: int) -> tuple[MeshShape, int, int, P.Perturbation | None]:
    """(mesh, sequence length, layers, perturbation), validated (BadInputError)."""
    mesh = MeshShape.parse(args.mesh) if args.mesh else MeshShape(sp=gpus or CPU_SP)
    if gpus and mesh.size > gpus:
        raise BadInputError(f"--mesh {mesh} needs {mesh.size} GPUs, but this machine has {gpus}")
    seq_len = args.seq_len or min((GPU_DEFAULTS if gpus else CPU_DEFAULTS)["seq_lens"][0], MAX_CHECK_SEQ_LEN)
    check_split(seq_len, mesh.sp, RING_LAYOUT)
    config = open_weights(args.model).config
    layers = args.layers or default_check_layers(config)
    if layers > config.num_layers:
        raise BadInputError(f"--layers must lie in 1..{config.num_layers}, got {layers}")
    perturb = P.parse(args.perturb, (args.backend,), parameter_shapes(config)) if args.perturb else None
    if perturb is not None and not perturb.on_attention:
        raise BadInputError(f"--perturb {args.perturb!r}: check takes an attention perturbation "
                            f"({args.backend}:attention-T=F); a weight's is `twinflash compare --perturb`'s")
    return mesh, seq_len, layers, perturb


def _run(args: argparse.Namespace, mesh: MeshShape, seq_len: int, layers: int, perturb: P.Perturbation | None,
         platform: str, work_dir: Path) -> dict:
    """The launch of the five jobs (module docstring), and the section from their results."""
    model = first_layers(prepared_weights(args.model, work_dir), layers, work_dir)
    reference = J.Job(id=f"{args.backend}-float32-step", kind="gradients", backend=args.backend, model=model,
                      seq_len=seq_len, devices=mesh.size, attention="reference", attention_backend="reference",
                      dtype="fp32", mode="forward", steps=1, mesh=str(mesh))
    jobs = fast_path_jobs(args.backend, platform, model, seq_len, [mesh.size], mesh.size, perturb, str(mesh))

    def on_done(job: J.Job) -> None:
        print(f"{job.id}: {J.read_result(work_dir, job.id)['status']}", file=sys.stderr, flush=True)

    command, env = side_launcher(args.backend, mesh.size, platform, work_dir)
    run_launch([reference, *jobs], command, env, work_dir, work_dir / "logs" / f"{args.backend}.log",
               args.job_timeout_s, on_done)
    return fast_path_section(jobs, work_dir, reference)


def run_command(args: argparse.Namespace) -> int:
    """`twinflash check` after argument parsing; raises BadInputError for bad input."""
    gpus = gpu_count()
    mesh, seq_len, layers, perturb = _settings(args, gpus)
    out = (args.out or Path("out") / f"check-{args.backend}-{datetime.datetime.now():%Y%m%d-%H%M%S}").resolve()
    check_output_dir(out, "--out", empty=True)
    work_dir = out / "work"
    (work_dir / "logs").mkdir(parents=True, exist_ok=True)
    with interruptible():
        try:
            section = _run(args, mesh, seq_len, layers, perturb, "gpu" if gpus else "cpu", work_dir)
        except Interrupted as stop:  # the launch is stopped (`compare.launch.owned_process`)
            print(f"twinflash: check interrupted ({stop.signal_name}); nothing judged", file=sys.stderr)
            return stop.exit_code
    write_text_atomically(out / "check.json", json.dumps(section, indent=1) + "\n")
    write_text_atomically(out / "check.md", markdown(fast_path_report.blocks({"equivalence": {"fast_path": section}})))
    for bulk in work_dir.glob("*.safetensors"):
        bulk.unlink()
    for directory in (WEIGHTS_DIR, "check-model"):
        shutil.rmtree(work_dir / directory, ignore_errors=True)
    print(f"twinflash check {args.backend} on {mesh}, S={seq_len}, {layers} layers: "
          f"{'PASSED' if section['passed'] else 'FAILED'}; {out / 'check.md'} (also check.json)")
    for line in section["failures"]:
        print(f"  {line}")
    return EXIT_OK if section["passed"] else EXIT_CHECK_FAILED
