"""Issue 20's step-efficiency settings, on CPU.

The XLA options the JAX train step is compiled with on GPUs (`jax_impl.parallel.step_compiler_options`): those
for overlapping communication with compute and the dynamic-slice fusion turned off (which ran the attention
forward twice: tests/test_remat_jax.py's GPU tests). Each is a knob with its spellings, newest XLA's first: this
jaxlib accepts a spelling of every knob (CI runs jax 0.10.x, whose pipeliners are booleans; the GPU machines
0.11.x, whose are modes), a knob takes its first accepted spelling and one with none is left out with a warning,
never a crash (made-up spellings as negative controls), the user's XLA_FLAGS win over them (any spelling of a
knob), none are set on CPU and only the fusion's with `--no-xla-overlap`, and a step compiled with them trains
exactly as one without (on CPU the GPU options change no computation: equal losses, bit for bit).

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
from jax_impl.parallel import (KERNEL_KNOBS, OVERLAP_KNOBS, accepted_compiler_options, sharded_batch,
                               step_compiler_options)
from jax_impl.train import build_training, step_scalars, train_step
from weights import preset
from weights.parallel import MeshShape
from weights.settings import TrainSettings
from weights.training import LOGITS_CHUNK_ELEMENTS, adamw_coefficients, default_loss_chunk_tokens

ALL_KNOBS = (*KERNEL_KNOBS, *OVERLAP_KNOBS)
MADE_UP = ("xla_gpu_twinflash_no_such_option", True)


def test_every_knob_has_a_spelling_this_xla_accepts():
    options = step_compiler_options("gpu", True, "")
    assert len(options) == len(ALL_KNOBS)
    assert all(option in knob for option, knob in zip(options, ALL_KNOBS))


def test_a_knob_takes_its_first_accepted_spelling_and_one_this_xla_lacks_is_left_out_with_a_warning(capsys):
    real = KERNEL_KNOBS[0][0]
    assert accepted_compiler_options(((MADE_UP, real),)) == (real,)  # an older spelling after a newer, unknown one
    assert capsys.readouterr().err == ""
    assert accepted_compiler_options(((real,), (MADE_UP,))) == (real,)
    assert "xla_gpu_twinflash_no_such_option" in capsys.readouterr().err


def test_none_on_cpu_only_the_kernel_knobs_when_turned_off_and_the_users_flags_win():
    assert step_compiler_options("cpu", True, "") == ()
    assert step_compiler_options("gpu", False, "") == tuple(knob[0] for knob in KERNEL_KNOBS)
    user = ("--xla_force_host_platform_device_count=2 --xla_gpu_enable_latency_hiding_scheduler=false "
            "--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_pipelined_all_gather=true")
    left = dict(step_compiler_options("gpu", True, user))
    assert not {"xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_enable_dynamic_slice_fusion",
                "xla_gpu_pipeline_all_gather", "xla_gpu_enable_pipelined_all_gather"} & left.keys()
    assert len(left) == len(ALL_KNOBS) - 3  # the user's older spelling of a knob leaves the whole knob to them
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
    for options in ((), step_compiler_options("gpu", True, "")):
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
