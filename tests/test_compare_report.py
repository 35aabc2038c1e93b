"""compare/report/: the report of `twinflash compare` from a synthetic report dict (GPU, train mode, torch and jax,
two context lengths, 1 and 4 devices, an attention ablation with an OOM and an unsupported point, one failing
equivalence comparison): every file written, the schema kept, the verdict / OOM / failing parameter / tolerance
reasons in both renderings, HTML escaped, invalid reports refused before anything is written; small values never
printed as 0.0, the CPU caveat on a CPU run (which ranks nothing) and not on a GPU run, exposed communication at
most the step, the peers' numbers kept and cited inside the project."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")  # a twinflash dependency the GPU image lacks: CPU tests only

from compare.harness import jobs as J
from compare.harness.plan import CompareSettings
from compare.report.data import benchmark_point
from compare.report.render import render_html, render_markdown
from compare.report.write import PEERS_CITATION, PEERS_PATH, SCHEMA_PATH, load_peers, validate_report, write_report
from weights import PRESETS

ROOT = Path(__file__).resolve().parent.parent

WHY_LOGITS = "fp32 logits; the ring changes the summation order only"
WHY_GRAD = "Triton vs XLA reduction order, amplified by 2 layers of backward"
FAILING_PARAMETER = "layers.1.feed_forward.w2.weight"
OOM_MESSAGE = "CUDA out of memory <tried to allocate 8.00 GiB>"


def _point(backend, seq_len, devices, attention="ours", status="ok", message=None):
    kernel = {"ours": {"torch": "triton", "jax": "pallas"}[backend], "vendor": f"{backend}_cudnn",
              "reference": "reference"}[attention]
    point = {"backend": backend, "seq_len": seq_len, "devices": devices, "attention": attention, "kernel": kernel,
             "status": status, "message": message, "trace": None}
    keys = ("step_s", "forward_s", "backward_s", "comm_s", "comm_exposed_s", "comm_bytes", "comm_bandwidth_gbps", "tokens_per_s",
            "tflops_per_device", "mfu", "peak_memory_bytes", "scaling_efficiency", "time_to_tokens_s")
    point.update(dict.fromkeys(keys))
    if status != "ok":
        return point
    slower = {"ours": 1.0, "vendor": 0.8, "reference": 3.0}[attention] * (1.1 if backend == "jax" else 1.0)
    step = slower * (0.02 + 1e-7 * seq_len**2) / devices**0.9
    tokens = 4 * seq_len / step
    point.update(step_s=step, forward_s=step / 3, backward_s=step * 0.6, tokens_per_s=tokens,
                 tflops_per_device=tokens * 6e6 / devices / 1e12, mfu=tokens * 6e6 / devices / 989e12,
                 peak_memory_bytes=int(2**20 * seq_len / devices + 3 * 2**30), time_to_tokens_s=1e9 / tokens,
                 scaling_efficiency=1 / devices**0.1, trace=f"traces/{backend}-{seq_len}-{devices}.json")
    if devices > 1:
        point.update(comm_s=step / 10, comm_exposed_s=step / 40, comm_bytes=4.0 * 2**20 * seq_len,
                     comm_bandwidth_gbps=4e-3 * seq_len / step)
    return point


def _parameters(names, failing=()):
    return [{"name": n, "max_abs_diff": 1e-6 * (i + 1) if n not in failing else 3e-3, "norm_ratio": 1.0 + 1e-7 * i,
             "passed": n not in failing} for i, n in enumerate(names)]


def _comparison(name, passed):
    grad = {"metric": "gradient max-abs (worst parameter)", "value": 1.5e-5 if passed else 3e-3, "tolerance": 1e-4,
            "passed": passed, "why": WHY_GRAD}
    names = [f"layers.{i}.{m}" for i in range(2) for m in ("attention.wq.weight", "attention.wk.weight",
             "attention.wv.weight", "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
             "feed_forward.w3.weight", "attention_norm.weight")] + ["tok_embeddings.weight", "output.weight"]
    return {"name": name, "passed": passed, "parameters": _parameters(names, () if passed else (FAILING_PARAMETER,)),
            "checks": [{"metric": "logits max-abs", "value": 2.4e-6, "tolerance": 1e-4, "passed": True,
                        "why": WHY_LOGITS}, grad]}


def make_report() -> dict:
    seq_lens, backends = [256, 512], ["torch", "jax"]
    points = [_point(b, s, d) for b in backends for s in seq_lens for d in (1, 4)]
    points += [_point("torch", s, 4, "vendor") for s in seq_lens] + [_point("torch", 256, 4, "reference"),
               _point("torch", 512, 4, "reference", "oom", OOM_MESSAGE), _point("jax", 256, 4, "vendor"),
               _point("jax", 512, 4, "vendor", "unsupported", "cuDNN attention needs S <= 256 here"),
               _point("jax", 256, 4, "reference"), _point("jax", 512, 4, "reference")]
    return {
        "format": "twinflash-compare/1", "command": "twinflash compare --model tiny --seq-lens 256,512",
        "created": "2026-11-21T10:00:00+00:00", "passed": False,
        "settings": {"model": "tiny", "mode": "train", "seq_lens": seq_lens, "device_counts": [1, 4], "devices": 4,
                     "steps": 6, "dtype": "fp32", "backends": backends,
                     "attention_ablation": ["ours", "vendor", "reference"], "time_to_tokens": 1_000_000_000},
        "environment": {"platform": "gpu", "devices": ["NVIDIA H200"] * 4, "driver": "580.0", "python": "3.11.9",
                        "libraries": {"torch": "2.13.0", "triton": None, "jax": "0.11.2", "jaxlib": "0.11.2",
                                      "flax": "0.12.0", "numpy": "2.3.0"},
                        "git_commit": "9f24d5f", "hostname": "ci", "cpu_count": 16},
        "model": {"name": "tiny", "num_params": 123_456, "layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2,
                  "head_dim": 32, "vocab": 256},
        "flops": {"formula": "6 * N * S + 12 * layers * heads * head_dim * S^2 / 2", "peak_flops_per_device": 989e12},
        "equivalence": {"seq_len": 256, "devices": 4, "layers": 2, "dtype": "fp32",
                        "reference": "plain-math attention in torch, 1 device", "passed": False,
                        "comparisons": [_comparison("torch vs reference", True), _comparison("jax vs reference", True),
                                        _comparison("torch vs jax", False)],
                        "loss_curves": {k: [5.6 - 0.1 * i + (0.001 if k == "jax" else 0) for i in range(6)]
                                        for k in ("torch", "jax", "reference")}},
        "benchmark": {"points": points},
        "peers": load_peers(),
    }


ALL_PLOTS = {f"plots/{n}.png" for n in ("throughput", "memory", "scaling", "breakdown", "ablation", "loss_curves")}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(the report given, out_dir): one write_report shared by the tests that only read its files."""
    report, out = make_report(), tmp_path_factory.mktemp("report") / "out"
    original = copy.deepcopy(report)
    write_report(report, out)
    assert report == original  # the caller's dict is left alone
    return original, out


def test_write_report_files_schema_and_plots(written):
    original, out = written
    data = json.loads((out / "report.json").read_text())
    jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text())).validate(data)
    validate_report(data)
    assert set(data["plots"]) == ALL_PLOTS
    assert data == {**original, "plots": data["plots"]}  # round trip
    assert sorted(p.name for p in out.iterdir()) == ["plots", "report.html", "report.json", "report.md"]
    assert sorted(p.name for p in (out / "plots").iterdir()) == sorted(p.split("/")[1] for p in ALL_PLOTS)
    for rel in data["plots"]:
        raw = (out / rel).read_bytes()
        assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 1000
        image = matplotlib.image.imread(out / rel)
        assert image.ndim == 3 and image.shape[2] in (3, 4) and 200 < image.shape[0] < 2000
        assert 300 < image.shape[1] < 3000


def test_renderings_show_verdict_oom_failures_and_tolerances(written):
    md, page = (written[1] / "report.md").read_text(), (written[1] / "report.html").read_text()
    for text in (md, page):
        assert "Verdict: FAIL" in text and "OOM" in text and "UNSUPPORTED" in text
        assert FAILING_PARAMETER in text and WHY_GRAD in text and WHY_LOGITS in text
        assert "torch vs jax: FAIL" in text and "torch vs reference: PASS" in text
        assert "tolerance" in text and "0.0001" in text and "0.003" in text
        for rel in ALL_PLOTS:
            assert rel in text
        assert "HF transformers + SDPA" in text and "TFLOP/s per GPU" in text  # peers table
        assert "traces/torch-512-4.json" in text
    assert "<tried to allocate" not in page and "&lt;tried to allocate 8.00 GiB&gt;" in page
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    assert "| torch | reference | reference | 512 | 4 | OOM |" in md
    assert "![loss curves](plots/loss_curves.png)" in md
    # tokens/s with thousands separators, times in ms below 1 s, memory in GiB
    assert any("," in cell and cell.replace(",", "").isdigit() for cell in md.split(" | "))
    assert " ms |" in md and " GiB |" in md and "time to 1B tokens" in md


def test_render_functions_handle_forward_mode_and_all_failed_points(tmp_path):
    report = make_report()
    report["settings"]["mode"] = "forward"
    report["equivalence"]["loss_curves"] = {}
    for i, p in enumerate(report["benchmark"]["points"]):
        if p["attention"] != "ours" or p["seq_len"] == 512:
            report["benchmark"]["points"][i] = _point(p["backend"], p["seq_len"], p["devices"], p["attention"],
                                                      "timeout" if i % 2 else "error", "killed after 600 s")
    report["equivalence"]["comparisons"][0]["checks"][0]["value"] = float("nan")
    report["equivalence"]["comparisons"][1]["parameters"][0]["max_abs_diff"] = np.float32(2.5e-6)  # numpy scalar
    report["equivalence"]["comparisons"][1]["checks"].append(  # a metric of the harness's own, extra keys
        {"metric": "loaded weights, worst relative sum difference", "value": 0.0, "tolerance": 1e-12, "passed": True,
         "why": "same weights"})
    report["equivalence"]["comparisons"][1]["parameters"][0]["weight_sum_diff"] = 0.0
    report["environment"]["libraries"]["jax"] = None  # --backends torch on a machine without jax
    write_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    validate_report(data)
    assert data["equivalence"]["comparisons"][1]["parameters"][0]["max_abs_diff"] == pytest.approx(2.5e-6)
    assert set(data["plots"]) == ALL_PLOTS - {"plots/loss_curves.png"}  # ablation: ours bars, failures as labels
    md = render_markdown(data)
    assert "TIMEOUT" in md and "ERROR" in md and "nan" in md and "Verdict: FAIL" in md
    assert "TIMEOUT" in render_html(data)
    # nothing measured at all: no plot is listed or written, the tables still render
    for p in report["benchmark"]["points"]:
        p.update(_point(p["backend"], p["seq_len"], p["devices"], p["attention"], "oom", None))
    write_report(report, tmp_path / "none")
    assert json.loads((tmp_path / "none" / "report.json").read_text())["plots"] == []
    assert not (tmp_path / "none" / "plots").exists()
    assert "OOM" in (tmp_path / "none" / "report.md").read_text()


def test_ours_vs_peer_line_where_a_point_measures_the_peers_work():
    report = {**make_report(), "plots": []}
    report["model"]["name"] = "llama3.2-1b"
    report["benchmark"]["points"][0].update(seq_len=8192, devices=1, mfu=0.38)
    md = render_markdown(report)
    assert "ours vs peer: torch ours (triton) S=8k on 1 device(s): 38 % MFU vs HF transformers + SDPA" in md
    assert "40.5 % MFU (0.94×; Llama-3.2-1B train step, 1 GPU, S=8k)" in md
    report["model"]["name"] = "tiny"
    assert "ours vs peer" not in render_markdown(report)


def test_peers_file():
    peers = load_peers()
    assert len(peers) == 8 and {p["unit"] for p in peers} == {"TFLOP/s", "TFLOP/s per GPU", "% MFU"}
    assert {p["value"] for p in peers} >= {544, 325, 543, 135, 367, 483, 40.5, 32.1}


@pytest.mark.parametrize("spoil, named", [
    (lambda r: r.pop("settings"), "'settings' is a required property"),
    (lambda r: r["benchmark"]["points"][3].pop("mfu"), "'mfu' is a required property"),
    (lambda r: r["benchmark"]["points"][2].update(status="crashed"), "$.benchmark.points[2].status"),
    (lambda r: r["settings"].update(mode="eval"), "$.settings.mode"),
    (lambda r: r["equivalence"]["comparisons"][1]["checks"][0].update(tolerance="small"),
     "$.equivalence.comparisons[1].checks[0].tolerance"),
    (lambda r: r["peers"][0].update(unit="TF"), "$.peers[0].unit"),
])
def test_invalid_reports_are_refused_and_nothing_written(tmp_path, spoil, named):
    report = make_report()
    spoil(report)
    with pytest.raises(ValueError, match="invalid compare report") as caught:
        validate_report({**report, "plots": []})
    message = str(caught.value)
    assert named in message and "\n" not in message
    out = tmp_path / "out"
    with pytest.raises(ValueError):
        write_report(report, out)
    assert not out.exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(ValueError):
        write_report(report, tmp_path / "kept")
    assert list((tmp_path / "kept").iterdir()) == []


def test_complete_report_validates_and_plots_key_is_required():
    report = make_report()
    validate_report({**report, "plots": ["plots/throughput.png"]})
    with pytest.raises(ValueError, match="'plots' is a required property"):
        validate_report(report)


TINY = {"tflops_per_device": 3.62e-05, "comm_bandwidth_gbps": 0.00118, "mfu": 4e-8, "comm_exposed_s": 2.5e-5,
        "comm_bytes": 900.0, "scaling_efficiency": 0.0004}
ALL_ZEROS = re.compile(r"(?<![\d.,])0\.0+(?![\d])")  # a number written as 0.0, 0.00, ...


def test_small_values_keep_significant_digits():
    report = {**make_report(), "plots": []}
    report["benchmark"]["points"][1].update(TINY)
    md = render_markdown(report)
    assert ALL_ZEROS.search(f"| {3.62e-05:,.1f} |")  # the negative control: the old one-decimal format
    assert not ALL_ZEROS.search(md), ALL_ZEROS.search(md)
    assert "3.62e-05" in md and "0.00118" in md and "900 B" in md


def test_a_cpu_run_says_so_at_the_top_and_ranks_nothing(tmp_path):
    gpu = {**make_report(), "plots": []}
    assert "CPU run" not in render_markdown(gpu)  # negative control
    assert "ours speed-up vs vendor" in render_markdown(gpu) and "the best point" in render_markdown(gpu)
    report = make_report()
    report["environment"].update(platform="cpu", devices=["cpu (4 emulated devices)"], driver=None)
    report["flops"]["peak_flops_per_device"] = None
    for p in report["benchmark"]["points"]:
        p.update(mfu=None, scaling_efficiency=None)
    write_report(report, tmp_path)
    md = (tmp_path / "report.md").read_text()
    head = md.split("## Setup")[0]
    assert "CPU run: not a benchmark." in head and "interpreter" in head and "emulated devices" in head
    assert "CPU run: not a benchmark." in (tmp_path / "report.html").read_text()
    for ranking in ("scaling efficiency |", "speed-up vs vendor", "the best point", "ours vs peer", "jax / torch"):
        assert ranking not in md
    assert "## Summary" in head and "a CPU run ranks nothing: no ratio" in head  # the summary, without ratios
    assert "plots/scaling.png" not in json.loads((tmp_path / "report.json").read_text())["plots"]


def test_exposed_communication_is_at_most_the_step():
    config = PRESETS["tiny"]
    job = J.Job(id="torch-s256-d4-ours", kind="bench", backend="torch", model="tiny", seq_len=256, devices=4,
                attention="ours", attention_backend="triton", dtype="fp32", mode="train", steps=2)
    settings = CompareSettings(model="tiny", mode="train", seq_lens=(256,), device_counts=(4,), devices=4, steps=2,
                               dtype="fp32", backends=("torch",), attention_ablation=("ours",),
                               activation_checkpointing="off", check_seq_len=256, check_layers=2, bench=True,
                               platform="cpu")
    result = {"status": "ok", "step_s": 0.5, "forward_s": 0.2, "comm_s": 0.9, "comm_exposed_s": 0.7,
              "peak_memory_bytes": 1 << 20}
    point = benchmark_point(job, result, config, settings)
    assert point["comm_exposed_s"] == 0.5 and point["comm_s"] == 0.9  # busy time may exceed the step
    assert benchmark_point(job, {**result, "comm_exposed_s": 0.1}, config, settings)["comm_exposed_s"] == 0.1
    md = render_markdown({**make_report(), "plots": []})
    assert "exposed comm (≤ step)" in md and "comm kernels busy" in md


def test_the_peers_are_kept_and_cited_inside_the_project():
    assert PEERS_PATH.resolve().is_relative_to(ROOT) and (ROOT / PEERS_CITATION) == PEERS_PATH
    kept = json.loads(PEERS_PATH.read_text())
    assert kept["machine"] and "H200" in kept["machine"] and kept["measured"]
    for path in (kept["raw"], kept["scripts"]):
        assert (ROOT / path).exists() and not Path(path).is_absolute() and ".." not in Path(path).parts
    for peer in load_peers():
        assert peer["source"].startswith(PEERS_CITATION) and peer["command"] and peer["machine"]
        assert "../" not in peer["source"] and "shared" not in peer["source"]
    md = render_markdown({**make_report(), "plots": []})
    assert PEERS_CITATION in md and "../" not in md


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_console_summary_fits_the_terminal(width):
    import io

    from rich.console import Console

    from compare.commands.compare import _summary_table

    out = io.StringIO()
    Console(file=out, width=width).print(_summary_table({**make_report(), "plots": []}, width))
    lines = out.getvalue().splitlines()
    assert lines and max(len(line) for line in lines) <= width
    assert not any("…" in line for line in lines)  # no cell cut short
    assert all(header in out.getvalue() for header in ("backend", "attn", "status", "step"))


def test_the_git_commit_is_the_checkouts_own_or_unknown(tmp_path):
    """A checkout without its own .git inside another repository: the report said the outer repository's commit
    (issue 33); it must say unknown. The negative control: the repository's own top does give its commit."""
    import subprocess

    from compare.report.data import checkout_commit

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "outer"], check=True)
    outer = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True,
                           check=True).stdout.strip()
    checkout = tmp_path / "twinflash"
    checkout.mkdir()
    assert checkout_commit(tmp_path) == outer
    assert checkout_commit(checkout) is None
    (tmp_path / "tracked.txt").write_text("a")
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked.txt"], check=True)
    assert checkout_commit(tmp_path) == f"{outer} + uncommitted changes"  # a newer tree under an older .git
    report = make_report()
    report["environment"]["git_commit"] = None
    assert "| git commit | unknown" in render_markdown(report)


def test_the_summary_comes_first_with_the_ratios_and_every_verdict(written):
    """The report's first screen answers the run's question (issue 36): the summary comes before the setup, with
    torch vs JAX per context length and device count (our kernels named), their ratio, one line per verdict and the
    headline plot, in both renderings."""
    md, page = (written[1] / "report.md").read_text(), (written[1] / "report.html").read_text()
    for text, setup in ((md, "## Setup"), (page, "<h2>Setup</h2>")):
        head = text.split(setup)[0]
        assert "Summary" in head and "plots/throughput.png" in head
        assert "jax / torch tokens/s (= MFU)" in head and "jax / torch peak memory" in head
        assert "torch triton; jax pallas" in head  # which kernels
        for verdict in ("fp32 torch vs reference", "fp32 jax vs reference", "fp32 torch vs jax"):
            assert verdict in head
        assert "twinflash compare --model" not in head  # the command opens the setup, below
        assert text.count("plots/throughput.png") == 1  # shown once, in the summary
    summary = md.split("## Summary")[1].split("## Setup")[0]
    torch_point, jax_point = (next(p for p in written[0]["benchmark"]["points"] if (p["backend"], p["seq_len"],
                              p["devices"], p["attention"]) == (b, 512, 4, "ours")) for b in ("torch", "jax"))
    ratio = f"{jax_point['tokens_per_s'] / torch_point['tokens_per_s']:.3g}×"
    assert f"| 512 | 4 | {torch_point['tokens_per_s']:,.0f} |" in summary and ratio in summary
    assert "| fp32 torch vs jax | FAIL | " in summary and "1 of 18 parameters' gradients" in summary
    assert md.index("## Summary") < md.index("## Setup") < md.index("## Equivalence") < md.index("## Benchmark")


def test_a_point_that_did_not_run_shows_its_status_once():
    """A row of a point that did not run says OOM once (HTML: one cell spanning the measurements; Markdown: then
    empty cells), not in each of its 13 measurement cells; in the summary, once over its backend's columns."""
    report = {**make_report(), "plots": []}
    md, page = render_markdown(report), render_html(report)
    row = next(line for line in md.splitlines() if line.startswith("| torch | reference | reference | 512 | 4 |"))
    assert row.count("OOM") == 1 and row.count("|") == 19  # 18 columns
    assert re.search(r'<td colspan=13 class=.status.>OOM</td>', page)
    old = "| OOM | OOM |"  # the negative control: the old rendering repeated it
    assert old not in md and "UNSUPPORTED | UNSUPPORTED" not in md
    for p in report["benchmark"]["points"]:
        if (p["backend"], p["attention"], p["seq_len"], p["devices"]) == ("jax", "ours", 256, 1):
            p.update(_point("jax", 256, 1, "ours", "timeout", "killed"))
    md = render_markdown(report)
    summary = md.split("## Summary")[1].split("## Setup")[0]
    line = next(line for line in summary.splitlines() if line.startswith("| 256 | 1 |"))
    assert line.count("TIMEOUT") == 1 and line.endswith("| TIMEOUT |  |  | – | – |")
    assert re.search(r'<td colspan=3 class=.status.>TIMEOUT</td>', render_html(report))


def test_rerender_writes_the_renderings_from_report_json_alone(written, tmp_path):
    """A committed report is rendered again from its report.json (no plot or work file needed): report.md and
    report.html change, report.json stays."""
    from compare.report.write import rerender

    (tmp_path / "report.json").write_text((written[1] / "report.json").read_text())
    rerender(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "report.json", "report.md"]
    assert (tmp_path / "report.md").read_text() == (written[1] / "report.md").read_text()
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(ValueError, match="invalid compare report"):
        rerender(tmp_path)
