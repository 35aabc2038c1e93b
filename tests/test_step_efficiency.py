"""Issue 20's step-efficiency settings, on CPU.

The XLA options the JAX train step is compiled with on GPUs (`jax_impl.parallel.step_compiler_options`): those
for overlapping communication with compute and the dynamic-slice fusion turned off (which ran the attention
forward twice: tests/test_remat_jax.py's GPU tests). This jaxlib accepts every one of them (CI runs jax 0.10.x,
the GPU machines 0.11.x: an option a version lacks is left out with a warning, never a crash: negative control with
a made-up option), the user's XLA_FLAGS win over them, none are set on CPU and only the fusion's with
`--no-xla-overlap`, and a step compiled with them trains exactly as one without (on CPU the GPU options change no
computation: equal losses, bit for bit).

The default loss chunk (`weights.training.default_loss_chunk_tokens`, both backends): whole GEMM tiles of rows
that divide the power-of-two lengths, within the logits budget.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from compare.commands.train import add_arguments
from weights.data import training_batches
from compare.args import OneLineParser
from jax_impl.parallel import (KERNEL_OPTIONS, OVERLAP_OPTIONS, accepted_compiler_options, sharded_batch,
                               step_compiler_options)
from jax_impl.train import build_training, step_scalars, train_step
from weights import preset
from weights.parallel import MeshShape
from weights.settings import TrainSettings
from weights.training import LOGITS_CHUNK_ELEMENTS, adamw_coefficients, default_loss_chunk_tokens

ALL_OPTIONS = (*KERNEL_OPTIONS.items(), *OVERLAP_OPTIONS.items())


def test_every_step_option_is_accepted_by_this_xla():
    assert step_compiler_options("gpu", True, "") == ALL_OPTIONS


def test_an_option_this_xla_lacks_is_left_out_with_a_warning(capsys):
    made_up = ("xla_gpu_twinflash_no_such_option", True)
    assert accepted_compiler_options((ALL_OPTIONS[0], made_up)) == (ALL_OPTIONS[0],)
    assert "xla_gpu_twinflash_no_such_option" in capsys.readouterr().err


def test_none_on_cpu_only_the_kernel_options_when_turned_off_and_the_users_flags_win():
    assert step_compiler_options("cpu", True, "") == ()
    assert step_compiler_options("gpu", False, "") == tuple(KERNEL_OPTIONS.items())
    user = ("--xla_force_host_platform_device_count=2 --xla_gpu_enable_latency_hiding_scheduler=false "
            "--xla_gpu_enable_dynamic_slice_fusion=true")
    left = dict(step_compiler_options("gpu", True, user))
    assert "xla_gpu_enable_latency_hiding_scheduler" not in left and "xla_gpu_enable_dynamic_slice_fusion" not in left
    assert len(left) == len(ALL_OPTIONS) - 2
    assert step_compiler_options("gpu", False, user) == ()


def test_the_command_line_turns_them_off():
    parser = OneLineParser(prog="twinflash train")
    add_arguments(parser)
    base = ["--backend", "jax", "--model", "tiny", "--seq-len", "64", "--steps", "2"]
    assert parser.parse_args(base).xla_overlap is True
    assert parser.parse_args([*base, "--no-xla-overlap"]).xla_overlap is False
    settings = TrainSettings(backend="jax", model="tiny", seq_len=64, steps=2, mesh=MeshShape(), batch=1)
    assert TrainSettings.from_json(dataclasses.replace(settings, xla_overlap=False).to_json()).xla_overlap is False


def test_a_step_compiled_with_the_options_trains_as_one_without():
    settings = TrainSettings(backend="jax", model="tiny", seq_len=64, steps=2, mesh=MeshShape(), batch=1,
                             attention_backend="reference", data="random")
    batch = training_batches(settings, preset("tiny"))[0]
    losses = []
    for options in ((), ALL_OPTIONS):
        run = build_training(settings, jax.devices()[:1])
        assert run.spec.compiler_options == ()  # CPU: none chosen
        spec = dataclasses.replace(run.spec, compiler_options=options)
        scalars = step_scalars(adamw_coefficients(settings.optimizer, 0))
        _, loss, _ = train_step(run.state, *sharded_batch(batch, run.mesh), scalars, spec=spec)
        losses.append(float(loss))
    assert np.isfinite(losses[0]) and losses[0] == losses[1]


def test_the_default_loss_chunk_is_whole_tiles_within_the_logits_budget():
    llama3_vocab = 128256
    rows = default_loss_chunk_tokens(llama3_vocab)
    assert rows == 2048 and rows * llama3_vocab <= LOGITS_CHUNK_ELEMENTS
    assert 16384 % rows == 0  # a device's 16k rows (32k tokens on sp=2): 8 chunks, no remainder chunk
    assert LOGITS_CHUNK_ELEMENTS // llama3_vocab % 256 != 0  # what the plain quotient would be (2092 rows)
    assert default_loss_chunk_tokens(256) == LOGITS_CHUNK_ELEMENTS // 256  # the tiny vocab: one chunk per device
    assert default_loss_chunk_tokens(LOGITS_CHUNK_ELEMENTS // 100) == 100  # under one tile: as many as fit
