"""`twinflash bench kernels`: single-GPU attention kernel throughput, our kernels against the peers, in one table.

Measured, bf16, batch 1, H=32 (defaults), for each S (--seq-lens), causal and not, Hkv in --kv-heads, D in --head-dim
(128 by default; e.g. 128,64), every implementation of the parts or those --impls names:
  torch part  triton      ours, `torch_impl.kernels.flash_attention.flash_attention` on [B, S, H, D] (GQA native)
              sdpa_flash  torch SDPA, FlashAttention-2 backend   } F.scaled_dot_product_attention on [B, H, S, D]
              sdpa_cudnn  torch SDPA, cuDNN backend              } under sdpa_kernel(...), enable_gqa for GQA
                          (a backend that refuses GQA is timed on K/V repeated beforehand, with a note)
              triton_portable, triton_hopper  with --triton-paths: each of our kernel families forced (the
                          backends of those names), beside "triton", which picks between them
  jax part    pallas      ours, `jax_impl.kernels.flash_attention.flash_attention` on [B, S, H, D] (default backend)
              pallas_hopper  ours forced to the Hopper Mosaic GPU kernels (backend="pallas_hopper")
              pallas_hopper_two_kernel  the same with the two-kernel backward (dK/dV, then dQ) in its own
                          orientation (the heuristic's HopperConfig with bwd_form="two_kernel", bwd_query_rows=False;
                          the heuristic's before 2026-11-29, which takes the one kernel of FA3); measured only when
                          --impls names it
              pallas_portable  ours forced to the Triton-lowering kernels (backend="pallas_portable"); measured only
                          when --impls names it
              jax_cudnn   jax.nn.dot_product_attention(implementation="cudnn") (GQA native)
              pallas_mha  JAX's shipped Pallas kernel, jax.experimental.pallas.ops.gpu.attention.mha
                          (K/V repeated to H heads outside the timed call, it has no GQA)
              tokamax     tokamax.dot_product_attention(implementation="mosaic")
              fa3         FlashAttention-3: flash_attn3_jax.flash_mha (GQA native); its row also records
                          max_err_vs_cudnn, the max |out - JAX cuDNN's out| on the same inputs (a sanity check)
                          tokamax and fa3 are optional peers (compare/bench/kernel_peers.py): pip install -e
                          ".[peers]"; an error row with that command where one is absent
Timing as the peers' anchor scripts (torch_kernels.py, jax_kernels.py) time them: torch with
triton.testing.do_bench (median, CUDA events); JAX with block_until_ready, median of repeated calls after two
warm-up calls (--jax-repeats). TFLOP/s from `weights.flops.attention_flops` for every implementation (so ratios are time ratios).

Roles of `python -m compare.bench.kernel_bench`: the plain invocation is the parent; it runs the torch part, then the
JAX part (XLA_PYTHON_CLIENT_PREALLOCATE=false), each as a subprocess `--part torch|jax` that prints one JSON
object per line, merges them (and the rows of --rows-from files: a sweep may be split over invocations) into one
table with ratios (RATIOS: ours / FA2, ours / cuDNN, pallas / shipped mha, pallas / JAX cuDNN, Mosaic / tokamax,
Mosaic / FA3, ...) and writes the JSON (--out). A peer that errors or runs out of memory is recorded as such and the
sweep goes on; a part that crashes or outlives --part-timeout-s is recorded as one error row.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from compare.args import OneLineParser, ints, lengths, recorded_command, with_error_contract
from compare.bench import common
from compare.bench.common import check_parts_and_heads, previous_rows, write_json
from compare.bench.kernel_peers import jax_peers
from compare.launch import Interrupted, interruptible, owned_process
from weights import BadInputError
from weights.flops import attention_flops

IMPLS = {"torch": ("triton", "sdpa_flash", "sdpa_cudnn"),
         "jax": ("pallas", "pallas_hopper", "jax_cudnn", "pallas_mha", "tokamax", "fa3")}
TRITON_PATHS = ("triton_portable", "triton_hopper")  # measured only when --triton-paths names them
EXTRA_IMPLS = {"jax": ("pallas_hopper_two_kernel", "pallas_portable")}  # measured only when --impls names them
KNOWN_IMPLS = tuple(i for part in IMPLS for i in (*IMPLS[part], *EXTRA_IMPLS.get(part, ())))
RATIOS = (("ours/FA2", "triton", "sdpa_flash"), ("ours/cuDNN", "triton", "sdpa_cudnn"),
          ("pallas/mha", "pallas", "pallas_mha"), ("pallas/jax-cuDNN", "pallas", "jax_cudnn"),
          ("mosaic/jax-cuDNN", "pallas_hopper", "jax_cudnn"), ("mosaic/tokamax", "pallas_hopper", "tokamax"),
          ("mosaic/fa3", "pallas_hopper", "fa3"), ("mosaic/two-kernel", "pallas_hopper", "pallas_hopper_two_kernel"))
PASSES = (("fwd", "fwd_tflops"), ("fwd+bwd", "fwdbwd_tflops"))
NO_CUDA = "bench kernels needs a CUDA GPU"


def jax_times_ms(fn, *inputs, repeats: int) -> list[float]:
    """Wall time (ms) of each of `repeats` calls of `fn(*inputs)`, in call order, after two warm-up calls,
    synchronising with block_until_ready."""
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*inputs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def median_ms(times: list[float]) -> float:
    """The median of `jax_times_ms`'s samples (the upper one of an even count)."""
    return sorted(times)[len(times) // 2]


def jax_median_ms(fn, *inputs, repeats: int) -> float:
    """Median wall time (ms) of `fn(*inputs)`: `median_ms` of `jax_times_ms`."""
    return median_ms(jax_times_ms(fn, *inputs, repeats=repeats))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="twinflash bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=lengths, default=(4096, 16384, 65536), help="e.g. 4k,16k,64k")
    parser.add_argument("--kv-heads", type=ints, default=(32, 8), help="Hkv values (H=32: MHA and GQA)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=ints, default=(128,), help="head dims, e.g. 128,64")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    parser.add_argument("--parts", default=",".join(IMPLS),
                        help=f"subset of {','.join(IMPLS)}; empty (--parts=) only merges the --rows-from files into "
                        "one table")
    parser.add_argument("--triton-paths", type=_choice_list("Triton path(s)", TRITON_PATHS), default=(),
                        help=f"also time our forced Triton paths, a subset of {','.join(TRITON_PATHS)}")
    parser.add_argument("--impls", type=_choice_list("implementation(s)", KNOWN_IMPLS),
                        help="only these implementations (default: every one of the parts; "
                        f"also {', '.join(i for extra in EXTRA_IMPLS.values() for i in extra)})")
    parser.add_argument("--jax-repeats", type=int, help="timed calls per JAX measurement (default 20, --quick 5)")
    parser.add_argument("--quick", action="store_true", help="smoke run: S=4k only, fewer repetitions")
    parser.add_argument("--part-timeout-s", type=float, default=1800.0, help="kill a part that runs longer")
    parser.add_argument("--rows-from", type=Path, action="append", default=[],
                        help="merge the rows of an earlier run's JSON (e.g. one part or length per invocation)")
    parser.add_argument("--out", type=Path, help="JSON path (default out/kernels-<date>-<gpu>.json)")
    parser.add_argument("--part", choices=tuple(IMPLS), help=argparse.SUPPRESS)
    return parser


def _choice_list(what: str, choices: tuple[str, ...]):
    """An argument type: comma-separated names out of `choices`, as a tuple; one line naming the unknown ones."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n for n in text.split(",") if n)
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(choices)}")
        return names

    return parse


def _check_args(args) -> None:
    if args.quick:
        args.seq_lens = (4096,)
    if args.jax_repeats is not None and args.jax_repeats < 1:
        raise BadInputError(f"--jax-repeats: at least 1, got {args.jax_repeats}")
    check_parts_and_heads(args, tuple(IMPLS))


def _part_impls(args, part: str) -> tuple[str, ...]:
    """The implementations a part measures: its own, or those of --impls that are its."""
    if args.impls is None:
        return IMPLS[part]
    return tuple(i for i in (*IMPLS[part], *EXTRA_IMPLS.get(part, ())) if i in args.impls)


def _points(args):
    """(S, causal, Hkv, D) points, in the order they are measured."""
    causals = {"both": (True, False), "causal": (True,), "full": (False,)}[args.causal]
    return [(s, c, kv, d) for d in args.head_dim for s in args.seq_lens for c in causals for kv in args.kv_heads]


def _result(args, impl, seq_len, causal, kv_heads, head_dim, fwd_ms=None, fwdbwd_ms=None, **extra) -> dict:
    row = dict(impl=impl, S=seq_len, causal=causal, kv_heads=kv_heads, heads=args.heads, head_dim=head_dim,
               batch=args.batch, **{k: v for k, v in extra.items() if v is not None})
    for key, ms, backward in (("fwd", fwd_ms, False), ("fwdbwd", fwdbwd_ms, True)):
        if ms is not None:
            flops = attention_flops(args.batch, args.heads, seq_len, seq_len, head_dim, causal, backward)
            row[f"{key}_ms"], row[f"{key}_tflops"] = ms, flops / (ms * 1e-3) / 1e12
    return row


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# ---------------------------------------------------------------------------------------------- torch part

def _torch_part(args) -> None:
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from torch_impl.kernels.flash_attention import flash_attention

    _emit({"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                    "python": sys.version.split()[0]}})
    warmup, rep = (10, 30) if args.quick else (25, 100)
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}

    def timings(attend, inputs, dout):
        fwd_ms = do_bench(lambda: attend(*inputs), warmup=warmup, rep=rep, return_mode="median")
        fwdbwd_ms = do_bench(lambda: attend(*inputs).backward(dout), warmup=warmup, rep=rep, return_mode="median",
                             grad_to_none=list(inputs))
        return fwd_ms, fwdbwd_ms

    def measure(impl, seq_len, causal, kv_heads, head_dim) -> dict:
        """One implementation at one point, on its own inputs (freed on return)."""
        def leaf(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        point = (args, impl, seq_len, causal, kv_heads, head_dim)
        if impl == "triton" or impl in TRITON_PATHS:
            def ours(q, k, v):
                return flash_attention(q, k, v, causal=causal, backend=impl)

            inputs = tuple(leaf(args.batch, seq_len, h, head_dim) for h in (args.heads, kv_heads, kv_heads))
            return _result(*point, *timings(ours, inputs, torch.randn_like(inputs[0])))

        def sdpa(q, k, v, gqa=kv_heads != args.heads):
            with sdpa_kernel([backends[impl]]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        # SDPA on [B, H, S, D] tensors, as the anchors measured it.
        inputs = tuple(leaf(args.batch, h, seq_len, head_dim) for h in (args.heads, kv_heads, kv_heads))
        dout = torch.randn_like(inputs[0])
        try:
            return _result(*point, *timings(sdpa, inputs, dout))
        except RuntimeError:
            if kv_heads == args.heads:
                raise
        # A backend without GQA support: time it on K/V repeated to H heads beforehand.
        repeated = (inputs[0], *(x.detach().repeat_interleave(args.heads // kv_heads, dim=1).requires_grad_()
                                 for x in inputs[1:]))
        return _result(*point, *timings(functools.partial(sdpa, gqa=False), repeated, dout),
                       note="no GQA in this backend: K/V repeated to H heads before the timed call")

    for point in _points(args):
        for impl in (*_part_impls(args, "torch"), *args.triton_paths):
            try:
                row = measure(impl, *point)
            except Exception as err:  # a peer's failure (OOM, unsupported shape) is a result, not a crash
                row = _result(args, impl, *point, error=f"{type(err).__name__}: {err}"[:300])
            _emit({"row": row})
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ JAX part

def _jax_part(args) -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    _emit({"meta": {"jax": jax.__version__, "jax_devices": [str(d) for d in jax.devices()]}})
    repeats = args.jax_repeats or (5 if args.quick else 20)
    impls, import_errors = {}, {}
    try:
        from jax_impl.kernels.flash_attention import flash_attention
        from jax_impl.kernels.hopper.config import default_config

        impls["pallas"] = lambda q, k, v, causal: flash_attention(q, k, v, causal=causal)
        impls["pallas_hopper"] = lambda q, k, v, causal: flash_attention(q, k, v, causal=causal,
                                                                         backend="pallas_hopper")
        impls["pallas_portable"] = lambda q, k, v, causal: flash_attention(q, k, v, causal=causal,
                                                                           backend="pallas_portable")
        def two_kernel(q):  # the heuristic's config for q but for the backward's form and orientation
            return dataclasses.replace(default_config(q.shape[-1], dtype=q.dtype), bwd_form="two_kernel",
                                       bwd_query_rows=False)
        impls["pallas_hopper_two_kernel"] = lambda q, k, v, causal: flash_attention(
            q, k, v, causal=causal, backend="pallas_hopper", config=two_kernel(q))
    except Exception as err:
        error = f"import: {type(err).__name__}: {err}"[:300]
        import_errors.update(pallas=error, pallas_hopper=error, pallas_hopper_two_kernel=error, pallas_portable=error)
    impls["jax_cudnn"] = lambda q, k, v, causal: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                              implementation="cudnn")
    try:
        from jax.experimental.pallas.ops.gpu import attention as shipped

        impls["pallas_mha"] = lambda q, k, v, causal: shipped.mha(q, k, v, None, sm_scale=1 / math.sqrt(q.shape[-1]),
                                                                  causal=causal)
    except Exception as err:
        import_errors["pallas_mha"] = f"import: {type(err).__name__}: {err}"[:300]
    peers, peer_errors = jax_peers()
    impls.update(peers)
    import_errors.update(peer_errors)

    def measure(impl, seq_len, causal, kv_heads, head_dim) -> dict:
        """One implementation at one point, on its own inputs (freed on return)."""
        attend = impls[impl]
        keys = jax.random.split(jax.random.key(0), 4)
        shapes = [(args.batch, seq_len, h, head_dim) for h in (args.heads, kv_heads, kv_heads, args.heads)]
        q, k, v, dout = (jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes))
        if impl == "pallas_mha":  # no GQA: K/V repeated to H heads outside the timed call
            k, v = (jnp.repeat(x, args.heads // kv_heads, axis=2) for x in (k, v))

        def loss(q, k, v, dout):  # dout an argument: closed over, XLA would fold it (and its transposes) at compile
            return jnp.sum(attend(q, k, v, causal).astype(jnp.float32) * dout.astype(jnp.float32))

        forward = jax.jit(lambda q, k, v: attend(q, k, v, causal))
        fwd_ms = jax_median_ms(forward, q, k, v, repeats=repeats)
        fwdbwd_ms = jax_median_ms(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, dout, repeats=repeats)
        check = {}
        if impl == "fa3":  # a foreign binding with its own conventions (mask, scale): is its output cuDNN's?
            cudnn_out = jax.jit(lambda q, k, v: impls["jax_cudnn"](q, k, v, causal))(q, k, v)
            check["max_err_vs_cudnn"] = float(jnp.max(jnp.abs(forward(q, k, v).astype(jnp.float32)
                                                              - cudnn_out.astype(jnp.float32))))
        return _result(args, impl, seq_len, causal, kv_heads, head_dim, fwd_ms, fwdbwd_ms, **check)

    for point in _points(args):
        for impl in _part_impls(args, "jax"):
            if impl in import_errors:
                row = _result(args, impl, *point, error=import_errors[impl])
            else:
                try:
                    row = measure(impl, *point)
                except Exception as err:  # a peer's failure (OOM, unsupported shape) is a result, not a crash
                    row = _result(args, impl, *point, error=f"{type(err).__name__}: {err}"[:300])
            _emit({"row": row})


# ------------------------------------------------------------------------------------------------- parent

def _child_args(args) -> list[str]:
    return ["--seq-lens", ",".join(map(str, args.seq_lens)), "--kv-heads", ",".join(map(str, args.kv_heads)),
            "--heads", str(args.heads), "--head-dim", ",".join(map(str, args.head_dim)), "--batch", str(args.batch),
            "--causal", args.causal] + (["--quick"] if args.quick else []) + (
                ["--triton-paths", ",".join(args.triton_paths)] if args.triton_paths else []) + (
                ["--impls", ",".join(args.impls)] if args.impls is not None else []) + (
                ["--jax-repeats", str(args.jax_repeats)] if args.jax_repeats else [])


def run_part(part: str, args) -> tuple[dict, list[dict]]:
    """Run one part in a subprocess; returns (meta, rows). Its stderr goes to the terminal."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if part == "jax":
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    command = [sys.executable, "-m", __spec__.name, "--part", part, *_child_args(args)]  # this module, as __main__ too
    print(f"[kernel bench] {part}: {shlex.join(command)}", file=sys.stderr, flush=True)
    meta, rows = {}, []
    with owned_process(command, env=env, stdout=subprocess.PIPE, text=True) as proc, proc.stdout:
        watchdog = threading.Timer(args.part_timeout_s, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                if not line.startswith("{"):
                    continue
                record = json.loads(line)
                meta.update(record.get("meta", {}))
                if "row" in record:
                    rows.append(dict(record["row"], part=part))
                    print(f"[kernel bench] {_progress(rows[-1])}", file=sys.stderr, flush=True)
            proc.wait()  # its end, not the end of its output, before the block stops what is left
        finally:
            watchdog.cancel()
    if proc.returncode:
        reason = (f"killed after --part-timeout-s {args.part_timeout_s:.0f}" if proc.returncode == -signal.SIGKILL
                  else f"exited with code {proc.returncode}")
        rows.append(dict(part=part, impl=f"{part} part", error=reason))
    return meta, rows


def _progress(row: dict) -> str:
    where = f"{row['impl']} D={row.get('head_dim')} S={row['S']} causal={row['causal']} Hkv={row['kv_heads']}"
    if row.get("error"):
        return f"{where}: {row['error'][:120]}"
    check = f", max err vs cuDNN {row['max_err_vs_cudnn']:.3g}" if "max_err_vs_cudnn" in row else ""
    return f"{where}: fwd {row['fwd_tflops']:.0f} TF/s, fwd+bwd {row['fwdbwd_tflops']:.0f} TF/s{check}"


def _table_impls(rows: list[dict]) -> list[str]:
    """IMPLS, then the forced Triton paths and extra implementations that some row measured."""
    measured = {r.get("impl") for r in rows}
    extras = (*TRITON_PATHS, *(i for part in EXTRA_IMPLS.values() for i in part))
    return [i for part in IMPLS.values() for i in part] + [p for p in extras if p in measured]


def merge_rows(rows: list[dict]) -> list[dict]:
    """One table row per (D, S, causal, Hkv, pass): TFLOP/s of every implementation ("error: ..." where it
    failed) and the ratios of RATIOS where both sides were measured."""
    points = sorted({(r.get("head_dim", 128), r["S"], r["causal"], r["kv_heads"]) for r in rows if "S" in r},
                    key=lambda p: (-p[0], p[1], not p[2], -p[3]))
    table = []
    for head_dim, seq_len, causal, kv_heads in points:
        at_point = {r["impl"]: r for r in rows if (r.get("head_dim", 128), r.get("S"), r.get("causal"),
                                                   r.get("kv_heads")) == (head_dim, seq_len, causal, kv_heads)}
        for pass_name, key in PASSES:
            entry = {"D": head_dim, "S": seq_len, "causal": causal, "kv_heads": kv_heads, "pass": pass_name}
            for impl in _table_impls(rows):
                row = at_point.get(impl)
                if row is not None:
                    entry[impl] = f"error: {row['error']}" if row.get("error") else row.get(key)
            for name, ours, peer in RATIOS:
                mine, theirs = entry.get(ours), entry.get(peer)
                if isinstance(mine, float) and isinstance(theirs, float) and theirs > 0:
                    entry[name] = mine / theirs
            table.append(entry)
    return table


def render_table(table: list[dict]):
    from rich.table import Table

    title = "Attention kernels, bf16, one GPU: TFLOP/s (weights.flops.attention_flops) and ratios"
    rich_table = Table(title=title)
    impls = _table_impls([{"impl": impl} for entry in table for impl in entry])
    for name in ("D", "S", "causal", "Hkv", "pass", *impls, *(r[0] for r in RATIOS)):
        rich_table.add_column(name, justify="right")
    for entry in table:
        cells = [str(entry.get("D", "")), f"{entry['S'] // 1024}k" if entry["S"] % 1024 == 0 else str(entry["S"]),
                 "yes" if entry["causal"] else "no", str(entry["kv_heads"]), entry["pass"]]
        for impl in impls:
            value = entry.get(impl)
            cells.append("" if value is None else "OOM" if "out of memory" in str(value).lower()
                         or "RESOURCE_EXHAUSTED" in str(value) else "err" if isinstance(value, str)
                         else f"{value:.0f}")
        cells += [f"{entry[name]:.2f}" if name in entry else "" for name, _, _ in RATIOS]
        rich_table.add_row(*cells)
    return rich_table


def default_out_path(meta: dict, today: datetime.date) -> Path:
    return common.default_out_path("kernels", meta, today)


def report(rows: list[dict], meta: dict, argv: list[str], out: Path | None) -> Path:
    from rich.console import Console

    table = merge_rows(rows)
    Console(width=220).print(render_table(table))
    for row in rows:
        if row.get("error") or row.get("note"):
            kind = "error" if row.get("error") else "note"
            print(f"[kernel bench] {kind}: {row.get('impl')} D={row.get('head_dim')} S={row.get('S')} causal={row.get('causal')} "
                  f"Hkv={row.get('kv_heads')}: {row.get('error') or row['note']}", file=sys.stderr)
    path = out or default_out_path(meta, datetime.date.today())
    write_json(path, {"command": recorded_command(["twinflash", "bench", "kernels", *argv]),
                      "date": datetime.datetime.now().isoformat(timespec="seconds"), "versions": meta,
                      "flops": "weights.flops.attention_flops(batch, heads, S, S, head_dim, causal, backward)",
                      "rows": rows, "table": table})
    print(f"[kernel bench] wrote {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return with_error_contract(lambda: _main(argv))


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    if args.part == "torch":
        _torch_part(args)
        return 0
    if args.part == "jax":
        _jax_part(args)
        return 0
    import torch

    if not torch.cuda.is_available():
        raise BadInputError(NO_CUDA)
    meta, rows = previous_rows(args.rows_from)
    with interruptible():
        try:
            for part in args.parts:
                part_meta, part_rows = run_part(part, args)
                meta.update(part_meta)
                rows += part_rows
        except Interrupted as stop:  # the part's process is stopped; nothing is written
            print(f"twinflash: bench kernels interrupted ({stop.signal_name}); nothing written", file=sys.stderr)
            return stop.exit_code
    report(rows, meta, argv, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
