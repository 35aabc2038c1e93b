"""`twinflash train --profile` on CPU (the CPU is the device: its ops are classified like kernels) in both
backends, the breakdown rule of `weights/profiling.py` on made-up timelines, the JAX classification of HLO
instructions and GPU kernels on a made-up HLO module, the sanity check (with negative
controls), and the fused AdamW of the torch step against the written-out one.

Tolerances:
  categories vs step: `weights.profiling.SUM_TOLERANCE` (15 %, the task's bound); the breakdown is built to sum
  exactly, so the real runs are also held to 1e-9 relative (float rounding of a few thousand additions).
  fused vs written-out AdamW: 1e-6 relative to the parameters' size after 5 steps: the same float32 formula in
  another order of operations differs by a few ulps (~1e-7 relative) per step.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from torch_impl.train import AdamW
from weights.profiling import (CATEGORIES, PROFILE_JSON, TOP_EVENTS, TOP_PRINTED, DeviceEvent, HostEvent, breakdown,
                               check_breakdown, format_table, host_costliest, profiled_steps)
from weights.schedule import OptimizerConfig
from weights.training import adamw_coefficients

LAUNCH_TIMEOUT_S = 600
EXACT_RTOL = 1e-9  # module docstring
FUSED_RTOL = 1e-6  # module docstring


def _profile(tmp_path_factory, backend: str, attention: str) -> dict:
    out = tmp_path_factory.mktemp(f"profile-{backend}")
    command = [sys.executable, "-m", "compare.commands.train", "--backend", backend, "--model", "tiny", "--seq-len", "64",
               "--steps", "3", "--mesh", "fsdp=1,sp=2", "--attention-backend", attention,
               "--activation-checkpointing", "full", "--out", str(out), "--profile"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "costliest device events" in done.stdout  # the table is printed
    return json.loads((out / PROFILE_JSON).read_text())


@pytest.fixture(scope="module", params=[("torch", "reference"), ("jax", "reference")], ids=["torch", "jax"])
def cpu_profile(request, tmp_path_factory) -> dict:
    return _profile(tmp_path_factory, *request.param)


def test_profile_breaks_the_step_into_every_category(cpu_profile):
    check_breakdown(cpu_profile)
    categories = cpu_profile["categories"]
    assert set(categories) == set(CATEGORIES)
    assert sum(categories.values()) == pytest.approx(cpu_profile["step_s"], rel=EXACT_RTOL)
    assert cpu_profile["steps"] == len(profiled_steps(0, 3)) == 2
    # every region of this run is found: attention (plain math here, marked as the attention function), the
    # layers' matmuls, the loss, the optimizer, the recomputation of "full" checkpointing, the ring's transfers
    for name in ("attention", "gemm", "elementwise", "loss", "optimizer", "recompute"):
        assert categories[name] > 0, name
    assert cpu_profile["communication_total_s"] > 0
    assert cpu_profile["backend"] in ("torch", "jax") and cpu_profile["device"]
    if cpu_profile["backend"] == "jax":  # on CPU the step's thunks are its HLO instructions (the few others: the
        lookup = cpu_profile["hlo_lookup"]  # host's scalar conversions between steps)
        assert lookup["events"] > 0 and lookup["found_in_hlo"] >= 0.9 * lookup["events"]
        assert 0 < lookup["with_region"] < lookup["events"]
        described = [item["hlo"] for item in cpu_profile["top"] if "hlo" in item]
        assert len(described) >= len(cpu_profile["top"]) // 2 and all("[" in what for what in described)


def _profile_of(categories: dict[str, float], step: float) -> dict:
    return {"step_s": step, "categories": categories, "communication_total_s": 0.0, "steps": 1, "top": []}


def test_check_breakdown_fails_without_a_category_or_beyond_the_tolerance():
    whole = dict.fromkeys(CATEGORIES, 0.1)
    check_breakdown(_profile_of(whole, 0.8))
    missing = {name: seconds for name, seconds in whole.items() if name != "optimizer"}
    with pytest.raises(ValueError, match="lacks"):
        check_breakdown(_profile_of(missing, 0.8))
    with pytest.raises(ValueError, match="sum"):  # 0.8 s of categories in a 1 s step: 20 % apart
        check_breakdown(_profile_of(whole, 1.0))


def test_breakdown_gives_every_instant_to_one_category():
    events = [
        DeviceEvent("gemm", 0.0, 4.0, "gemm"),
        DeviceEvent("inner", 1.0, 2.0, "elementwise", frozenset({"loss"})),  # nested: the innermost wins
        DeviceEvent("nccl", 3.0, 6.0, "communication"),  # hidden 3..4, exposed 4..6
        DeviceEvent("attn", 7.0, 8.0, "elementwise", frozenset({"attention", "recompute"})),
        DeviceEvent("outside", 20.0, 21.0, "gemm"),  # outside every window
    ]
    profile = breakdown(events, [(0.0, 5.0), (5.0, 10.0)])
    per_step = {name: seconds * 2 for name, seconds in profile["categories"].items()}
    assert per_step == pytest.approx({**dict.fromkeys(CATEGORIES, 0.0), "gemm": 3.0, "loss": 1.0,
                                      "communication_exposed": 2.0, "recompute": 1.0, "idle": 3.0})
    assert profile["step_s"] == 5.0 and profile["communication_total_s"] == 1.5
    assert "communication_exposed" in format_table(profile)


def test_top_events_count_their_calls_per_step():
    """A kernel launched twice a step shows 2 calls a step (how a doubled forward is seen); an event crossing
    into the next step counts in the step it started in; the negative control: once a step gives 1."""
    twice = [DeviceEvent("fwd", start, start + 1.0, "gemm") for start in (0.0, 2.0, 5.0, 7.0)]
    once = [DeviceEvent("bwd", start, start + 1.0, "gemm") for start in (4.5, 9.5)]  # each runs into the next step
    profile = breakdown(twice + once, [(0.0, 5.0), (5.0, 10.0)])
    calls = {item["name"]: item["calls"] for item in profile["top"]}
    assert calls == {"fwd": 2.0, "bwd": 1.0}
    assert "   2.0  gemm" in format_table(profile)
    many = breakdown([DeviceEvent(f"k{i}", i, i + 0.5, "gemm") for i in range(TOP_EVENTS + 5)], [(0.0, 100.0)])
    assert len(many["top"]) == TOP_EVENTS and format_table(many).count(" gemm ") == TOP_PRINTED


def test_host_costliest_counts_self_time_per_thread_and_step():
    main, side = ("p", 1), ("p", 2)
    events = [
        HostEvent("twinflash/step", 0.0, 10.0, main),  # self: 10 - 6 (op) - 1 (launch) = 3, Python between ops
        HostEvent("aten::op", 1.0, 7.0, main),  # self: 6 - 2 (its launch)
        HostEvent("cudaLaunchKernel", 2.0, 4.0, main),
        HostEvent("cudaLaunchKernel", 8.0, 9.0, main),  # a child of the step, not of the op that ended at 7
        HostEvent("aten::op", 2.5, 3.5, side),  # another thread: no parent, not nested under main's launch
        HostEvent("aten::op", 11.0, 19.0, main),  # outside the window
    ]
    top = {item["name"]: item["seconds"] for item in host_costliest(events, [(0.0, 10.0)])}
    assert top == pytest.approx({"aten::op": 5.0, "cudaLaunchKernel": 3.0, "twinflash/step": 3.0})
    halved = {item["name"]: item["seconds"] for item in host_costliest(events, [(0.0, 10.0), (10.0, 20.0)])}
    assert halved["aten::op"] == pytest.approx((5.0 + 8.0) / 2)  # per step over two steps
    profile = {**breakdown([DeviceEvent("gemm", 0.0, 4.0, "gemm")], [(0.0, 10.0)]),
               "host_top": host_costliest(events, [(0.0, 10.0)], top=2)}
    table = format_table(profile)
    assert "costliest host operations" in table and table.count("\n  ") == 1 + 2  # one device row, two host rows


def test_torch_host_events_are_the_host_spans_of_a_trace():
    from torch_impl.profiling import host_events

    def span(name, cat, ts, tid=7):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": 2.0, "pid": 1, "tid": tid}

    trace = {"traceEvents": [span("aten::mm", "cpu_op", 0.0), span("twinflash/step", "user_annotation", 0.0),
                             span("cudaLaunchKernel", "cuda_runtime", 1.0), span("nvjet_gemm", "kernel", 3.0, tid=9),
                             {"ph": "i", "name": "instant", "cat": "cpu_op", "ts": 1.0, "pid": 1, "tid": 7}]}
    assert [(e.name, e.thread) for e in host_events(trace)] == [
        ("aten::mm", (1, 7)), ("twinflash/step", (1, 7)), ("cudaLaunchKernel", (1, 7))]


def test_fused_adamw_agrees_with_the_written_out_one():
    config = OptimizerConfig(lr=1e-2, warmup_steps=1, total_steps=10, weight_decay=0.1)

    def parameters() -> dict[str, nn.Parameter]:
        generator = torch.Generator().manual_seed(0)
        return {"matrix": nn.Parameter(torch.randn(64, 32, generator=generator)),
                "norm": nn.Parameter(torch.randn(32, generator=generator))}

    written, fused = parameters(), parameters()
    optimizers = AdamW(written, config), AdamW(fused, config, fused=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(5):
        for name, p in written.items():
            p.grad = torch.randn(p.shape, generator=generator)
            fused[name].grad = p.grad.clone()
        for optimizer in optimizers:
            optimizer.step(adamw_coefficients(config, step), step)
    for name, p in written.items():
        assert not torch.equal(p, parameters()[name])  # it trained
        torch.testing.assert_close(fused[name], p, rtol=0, atol=FUSED_RTOL * p.abs().max().item())
    # negative control: without weight decay on the matrix the fused step is off by far more than the tolerance
    undecayed = parameters()
    optimizer = AdamW(undecayed, OptimizerConfig(lr=1e-2, warmup_steps=1, total_steps=10, weight_decay=0.0),
                      fused=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(5):
        for p in undecayed.values():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step(adamw_coefficients(config, step), step)
    assert (undecayed["matrix"] - written["matrix"]).abs().max() > 10 * FUSED_RTOL * written["matrix"].abs().max()


def test_profile_needs_an_output_directory(capsys):
    from compare.commands.train import main

    assert main(["--model", "tiny", "--seq-len", "64", "--steps", "3", "--profile"]) == 2
    assert "--profile needs --out" in capsys.readouterr().err


# A compiled step as XLA prints it: the region marks (`jax_impl.profiling.region`) live in each instruction's op_name
_HLO_TEXT = """HloModule jit_train_step, is_scheduled=true

%fused_computation.1 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %multiply.1 = f32[4]{0} multiply(%param_0, %param_0)
}

%fused_computation.2 (param_0.1: bf16[4,4], param_1.1: bf16[4,4]) -> bf16[4,4] {
  %param_0.1 = bf16[4,4]{1,0} parameter(0)
  %param_1.1 = bf16[4,4]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4,4]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation.3 (param_0.2: f32[4]) -> f32[4] {
  ROOT %param_0.2 = f32[4]{0} parameter(0)
}

ENTRY %main.9 {
  %a = f32[4]{0} parameter(0)
  %b = bf16[4,4]{1,0} parameter(1)
  %loop_multiply_fusion.32 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1, \
metadata={op_name="jit(train_step)/twinflash_optimizer/mul"}
  %gemm_fusion.3 = bf16[4,4]{1,0} fusion(%b, %b), kind=kCustom, calls=%fused_computation.2, \
metadata={op_name="jit(train_step)/transpose(jvp())/checkpoint/rematted_computation/twinflash_attention/dot_general"}
  %loop_exp_fusion.4 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation.3, \
metadata={op_name="jit(train_step)/transpose(jvp(twinflash_loss))/checkpoint/rematted_computation/exp"}
  %all-gather-start = (bf16[4,4]{1,0}, bf16[8,4]{1,0}) all-gather-start(%gemm_fusion.3), dimensions={0}
  ROOT %tuple.1 = (f32[4]{0}, bf16[4,4]{1,0}) tuple(%loop_multiply_fusion.32, %gemm_fusion.3)
}
"""


def test_jax_hlo_classification_of_instructions_and_kernels():
    from weights.profiling import category
    from jax_impl.profiling import _Hlo, _short_shape

    hlo = _Hlo(_HLO_TEXT)  # the entry computation printed without its program shape (as GPU texts may be)
    optimizer = ("elementwise", frozenset({"optimizer"}))
    assert hlo.classify("loop_multiply_fusion.32", "loop_multiply_fusion_32", "") == optimizer
    assert hlo.classify("", "loop_multiply_fusion_32", "") == optimizer  # found by the kernel's own name
    assert hlo.classify("gemm_fusion.3", "gemm_fusion_3", "") == ("gemm", frozenset({"attention", "recompute"}))
    assert hlo.classify("all-gather-start", "ncclDevKernel_AllGather", "")[0] == "communication"
    # the loss chunks' logits recomputed for the backward are the loss's, not the layers' recomputation
    kind, regions = hlo.classify("loop_exp_fusion.4", "loop_exp_fusion_4", "")
    assert regions == {"loss", "recompute"} and category(kind, regions) == "loss"
    # not in the HLO (jax 0.11.2 on GPU): the kind from the kernel's name, the regions from the event's annotation
    assert hlo.classify("fusion.404", "nvjet_sm90_tst_128x256", "") == ("gemm", frozenset())
    annotation = "XlaModule:#prefix=jit(train_step),hlo_module=jit_train_step# transpose(jvp(twinflash_loss))/dot"
    assert hlo.classify("custom-call.9", "nvjet_sm90_tst_128x256", annotation) == ("gemm", frozenset({"loss"}))
    assert hlo.classify("", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "a/twinflash_attention/b") == (
        "attention", frozenset({"attention"}))
    assert hlo.classify("", "loop_add_fusion_7", "jvp()/rematted_computation/add") == (
        "elementwise", frozenset({"recompute"}))
    # negative control: a scope that is not a region's, or a region's name without the mark, is no region
    assert hlo.classify("", "loop_add_fusion_7", "jit(train_step)/loss/twinflash_lossy/add")[1] == frozenset()
    # what a kernel computes, for the profile's costliest list: shape, fusion kind and ops, where in the step
    assert hlo.describe("loop_multiply_fusion_32") == "f32[4] fusion kLoop of multiply: twinflash_optimizer/mul"
    assert hlo.describe("gemm_fusion_3") == "bf16[4,4] fusion kCustom of dot: twinflash_attention/dot_general"
    assert hlo.describe("all-gather-start") == "(bf16[4,4], bf16[8,4]) all-gather-start"
    assert hlo.describe("nvjet_sm90_tst_128x256") == ""  # not in the HLO: nothing made up
    assert hlo.describe("tuple.1") == "(f32[4], bf16[4,4]) tuple"
    state = "(s32[], f32[2,4], /*index=2*/bf16[8], f32[])"
    assert _short_shape(state) == "(s32[], f32[2,4], ... 4 arrays)" and _short_shape(state, 4) == (
        "(s32[], f32[2,4], bf16[8], f32[])")


def test_jax_region_marks_reach_the_compiled_step():
    """The step's code marks its regions with named scopes; XLA keeps them in the op_name of the forward, the
    backward and the recomputed instructions alike (what the classification reads)."""
    import jax
    import jax.numpy as jnp

    from jax_impl.profiling import _Hlo, region

    def loss(w, x):
        layer = jax.checkpoint(lambda x: _attend(x @ w))
        with region("loss"):
            return jnp.sum(jnp.exp(layer(x)))

    def _attend(x):
        with region("attention"):
            return jnp.tanh(x)

    def step(w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        with region("optimizer"):
            return w - 0.1 * grad, value

    w = jnp.full((8, 8), 0.1)
    hlo = _Hlo(jax.jit(step).lower(w, w).compile().as_text())
    found = {hlo.classify(name, name, "")[1] for name in hlo.instructions}
    assert frozenset({"optimizer"}) in found
    assert frozenset({"loss", "attention", "recompute"}) in found  # tanh rerun in the backward
    assert any(regions >= {"loss", "attention"} and "recompute" not in regions for regions in found)
    with pytest.raises(ValueError, match="unknown region"):
        region("matmuls")


def _event(metadata: int, start_us: float, duration_us: float, hlo_op: str, annotation: int) -> str:
    return (f"events {{ metadata_id: {metadata} offset_ps: {int(start_us * 1e6)} duration_ps: {int(duration_us * 1e6)}"
            f' stats {{ metadata_id: 1 str_value: "{hlo_op}" }} stats {{ metadata_id: 2 ref_value: {annotation} }} }}')


def test_jax_gpu_trace_regions_come_from_the_kernels_annotations(tmp_path):
    """A made-up GPU trace of one step (the XSpace a GPU run writes: device 0's streams, the step's annotation on
    the host) whose kernels' HLO instructions are not in the HLO text, as on jax 0.11.2: the regions come from the
    op_name each kernel's annotation carries, the kinds from the kernel names, and device 1 is not counted."""
    from jax.profiler import ProfileData

    from jax_impl.profiling import _Hlo, trace_events

    names = {1: "nvjet_sm90_tst_128x256_h_bz_TNT", 2: "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_kernel0",
             3: "loop_multiply_fusion_3", 4: "input_reduce_fusion_9", 5: "ncclDevKernel_SendRecv"}
    scopes = {3: "XlaModule:transpose(jvp(twinflash_loss))/dot_general",
              4: "XlaModule:jvp(twinflash_attention)/shard_map/custom_vjp_call", 5: "XlaModule:twinflash_optimizer/mul",
              6: "XlaModule:jvp()/add"}
    metadata = "\n".join(f'event_metadata {{ key: {k} value {{ id: {k} name: "{v}" }} }}' for k, v in names.items())
    strings = "\n".join(f'stat_metadata {{ key: {k} value {{ id: {k} name: "{v}" }} }}' for k, v in scopes.items())
    stats = 'stat_metadata { key: 1 value { id: 1 name: "hlo_op" } } stat_metadata { key: 2 value { id: 2 name: "tf_op" } }'

    def device(index: int) -> str:
        compute = " ".join([_event(1, 0, 2000, "custom-call.7", 3), _event(2, 2000, 3000, "custom-call.8", 4),
                            _event(3, 5000, 1000, "loop_multiply_fusion.3", 5),
                            _event(4, 6000, 1000, "input_reduce_fusion.9", 6)])
        nccl = _event(5, 6500, 2000, "collective-permute-start.1", 6)  # 500 us hidden, 1500 exposed
        return (f'planes {{ id: {index + 1} name: "/device:GPU:{index}" '
                f'lines {{ id: 1 name: "Stream #14(Compute)" timestamp_ns: 0 {compute} }} '
                f'lines {{ id: 2 name: "Stream #20(Nccl)" timestamp_ns: 0 {nccl} }} {metadata} {strings} {stats} }}')

    host = ('planes { id: 9 name: "/host:CPU" lines { id: 1 name: "python" timestamp_ns: 0 '
            'events { metadata_id: 1 offset_ps: 0 duration_ps: 10000000000 } } '
            'event_metadata { key: 1 value { id: 1 name: "twinflash/step" } } }')
    xplane = tmp_path / "trace.xplane.pb"
    xplane.write_bytes(ProfileData.text_proto_to_serialized_xspace(device(0) + device(1) + host))
    events, windows, lookup = trace_events(str(xplane), _Hlo(_HLO_TEXT))
    assert windows == [(0.0, 0.01)] and len(events) == 5  # device 1's kernels left out
    assert lookup["found_in_hlo"] == 0 and lookup["with_region"] == 3 and len(lookup["not_found"]) == 5
    per_step_us = {name: round(seconds * 1e6) for name, seconds in breakdown(events, windows)["categories"].items()}
    assert per_step_us == {"attention": 3000, "gemm": 0, "communication_exposed": 1500, "elementwise": 1000,
                           "loss": 2000, "optimizer": 1000, "recompute": 0, "idle": 1500}
