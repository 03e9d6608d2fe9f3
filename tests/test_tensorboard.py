"""Short CLI runs write the expected TensorBoard tags, and a real ``tensorboard`` server serves them."""
from __future__ import annotations

import json
import math
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.run import main
from tests.conftest import TINY_RUN

FREQUENT = ["--max_steps", "4", "--val_every", "4", "--trainer.log_every_n_steps", "1",
            "--callbacks.routing_every", "2", "--callbacks.routing_images_every", "2", "--callbacks.flops_every", "2",
            "--callbacks.contribution_every", "2", "--callbacks.throughput_window", "2"]


def _events(run_dir: pathlib.Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0, "scalars": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    return events


@pytest.fixture(scope="module")
def mod_run(tmp_path_factory) -> pathlib.Path:
    return main(["--variant", "mod", "--log_dir", str(tmp_path_factory.mktemp("tb")), *TINY_RUN, *FREQUENT])


def test_event_files_hold_routing_flops_contribution_layout_and_hparams(mod_run):
    events = _events(mod_run)
    tags = events.Tags()
    scalars = set(tags["scalars"])
    for site in ("block1.mod",):  # TINY_RUN has 2 layers: block 1 is the only routed one ("odd")
        assert {f"routing/{site}/frac/skip", f"routing/{site}/frac/block", f"routing/{site}/processed_fraction"} <= scalars
        assert f"routing/{site}/weights" in tags["histograms"]
    assert {"flops/forward", "flops/training", "flops/ratio_to_vanilla", "flops/forward/attn_proj",
            "flops/forward/attn_scores", "flops/forward/ffn", "flops/forward/router", "flops/forward/head"} <= scalars
    assert {"train/device/flops_per_sec", "train/device/items_per_sec"} <= scalars  # ThroughputMonitor
    assert {"contribution/acc/00.embed", "contribution/acc/01.mha0", "contribution/dla/04.ffn1",
            "contribution/acc_final"} <= scalars
    assert {"routing/map", "contribution/by_state"} <= set(tags["images"])
    assert "custom_scalars__config__" in tags["tensors"]
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
    assert "hparams/flops/ratio_to_vanilla" in scalars and "hparams/val/loss" in scalars
    # the logged FLOPs are the summary's (same trace of the last step)
    summary = json.loads((mod_run / "summary.json").read_text())
    logged = {e.step: e.value for e in events.Scalars("flops/forward")}
    assert logged[3] == pytest.approx(summary["flops_per_token"]["forward"], rel=1e-6)  # batch 3 = the 4th step
    processed = events.Scalars("routing/block1.mod/processed_fraction")[-1].value
    assert processed == pytest.approx(0.125, abs=1 / 64)  # mod.capacity


def _steps(events, tag):
    return sorted({e.step for e in events.Scalars(tag)})


def test_one_x_axis_and_final_numbers_at_the_end_of_the_run(mod_run):
    """Lightning's scalars and the callbacks' share the x value of a batch; hparams hold the final validation."""
    events = _events(mod_run)
    assert _steps(events, "train/loss") == [0, 1, 2, 3]  # log_every_n_steps 1; x = index of the batch
    assert _steps(events, "routing/block1.mod/frac/skip") == [1, 3]  # routing_every 2: steps 2 and 4
    assert _steps(events, "flops/forward") == [1, 3] and _steps(events, "contribution/acc_final") == [1, 3]
    assert _steps(events, "lr-AdamW/pg1")[-1] == 3 and _steps(events, "val/loss") == [3]  # in fit and final
    # MoD's top-k routing sees the future: causal evaluation and predictor quality next to val/loss
    scalars = set(events.Tags()["scalars"])
    assert {"val/loss_causal", "val/ppl_causal", "hparams/val/loss_causal"} <= scalars
    assert {f"val/predictor/block1.mod/{k}" for k in ("precision", "recall", "f1", "accuracy")} <= scalars
    summary = json.loads((mod_run / "summary.json").read_text())
    final = events.Scalars("val/loss")[-1].value
    assert events.Scalars("hparams/val/loss")[-1].value == pytest.approx(final)
    assert summary["val_metrics"]["val/loss_causal"] == pytest.approx(events.Scalars("val/loss_causal")[-1].value)
    assert summary["val_metrics"]["val/ppl_causal"] == pytest.approx(math.exp(summary["val_metrics"]["val/loss_causal"]))
    # routing numbers saved per logging step; summary routing = the global batch of the last step
    records = [json.loads(line) for line in (mod_run / "routing" / "stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 3]
    counts = records[-1]["sites"]["block1.mod"]["counts"]
    assert summary["routing"]["block1.mod"]["block"] == pytest.approx(counts[1] / sum(counts))
    assert [s for s, _ in summary["train_loss_curve"]] == [1, 2, 3, 4] and summary["median_step_time_s"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        body = response.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body


def test_tensorboard_server_serves_the_scalars_and_images(mod_run):
    port = _free_port()
    logdir = mod_run.parent
    tensorboard = pathlib.Path(sys.executable).with_name("tensorboard")
    command = [str(tensorboard) if tensorboard.exists() else "tensorboard", "--logdir", str(logdir),
               "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false", "--reload_interval", "1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    try:
        deadline = time.time() + 120
        scalars = images = {}
        while time.time() < deadline:
            try:
                scalars = _get(port, "/data/plugin/scalars/tags")
                images = _get(port, "/data/plugin/images/tags")
                if scalars.get(mod_run.name, {}).get("flops/forward") and images.get(mod_run.name):
                    break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            time.sleep(1)
        run = mod_run.name
        assert "routing/block1.mod/processed_fraction" in scalars[run]
        assert "contribution/acc_final" in scalars[run]
        assert {"routing/map", "contribution/by_state"} <= set(images[run])
        query = urllib.parse.urlencode({"run": run, "tag": "flops/forward"})
        series = _get(port, f"/data/plugin/scalars/scalars?{query}")
        events = _events(mod_run)
        assert [(s, v) for _, s, v in series] == [(e.step, pytest.approx(e.value)) for e in events.Scalars("flops/forward")]
        query = urllib.parse.urlencode({"run": run, "tag": "routing/map", "sample": 0})
        entries = _get(port, f"/data/plugin/images/images?{query}")
        png = _get(port, "/data/plugin/images/individualImage?" + entries[-1]["query"])
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        layout = _get(port, "/data/plugin/custom_scalars/layout")
        assert "routing/block1.mod" in [c["title"] for c in layout["category"]]
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.mark.slow
def test_moe_run_logs_entropy_imbalance_drops_and_transitions(tmp_path):
    run_dir = main(["--variant", "moe", "--model.moe.num_experts", "4", "--model.moe.top_k", "2",
                    "--model.moe.dropless", "false", "--log_dir", str(tmp_path), *TINY_RUN, *FREQUENT])
    tags = _events(run_dir).Tags()
    for site in ("layer0.moe", "layer1.moe"):
        assert {f"routing/{site}/entropy", f"routing/{site}/load_cv", f"routing/{site}/dropped_fraction",
                f"routing/{site}/frac/expert3"} <= set(tags["scalars"])
    assert "routing/moe/transitions" in tags["images"]
