"""``python -m experiments.analyze contribution``: logit lens, linear probes and k-means MI on a checkpoint."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from datamodules.lm import DataConfig, LMDataModule
from analysis.contribution import contribution, mutual_information
from experiments.analyze import main
from lightning_modules.lm import LanguageModelModule
from tests.conftest import REPO

T = 32


def _train_briefly(module: LanguageModelModule, blocks: torch.Tensor, steps: int = 25) -> None:
    """Enough steps on the embedded corpus that the top layers predict better than the embeddings."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(module.model.parameters(), lr=1e-2)
    for step in range(steps):
        batch = blocks[torch.randint(0, len(blocks), (8,))]
        logits = module.model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.fixture(scope="module")
def zeroed_ffn_run(tmp_path_factory):
    """A run folder like experiments.run writes one: checkpoints/last.ckpt + config.yaml (embedded corpus)."""
    run = tmp_path_factory.mktemp("run") / "vanilla-tiny" / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    data = LMDataModule(DataConfig(), block_size=T, seed=3)
    data.prepare_data()
    data.setup("fit")
    blocks = torch.stack([data.train_set[i] for i in range(256)])
    L.seed_everything(0, verbose=False)
    module = LanguageModelModule(model=dict(variant="vanilla", vocab_size=data.vocab_size, d_model=32, n_layer=2,
                                            n_head=2, block_size=T))
    _train_briefly(module, blocks)
    with torch.no_grad():
        for block in module.model.blocks:  # FFN updates become exactly zero
            block.mlp.c_proj.weight.zero_()
            block.mlp.c_proj.bias.zero_()
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": L.__version__}, run / "checkpoints" / "last.ckpt")
    (run / "config.yaml").write_text(yaml.safe_dump({"seed": 3, "data": {"name": "embedded", "batch_size": 4}}))
    return run


@pytest.mark.parametrize("method", ["logit_lens", "mi", "probe"])
def test_zeroed_ffns_give_ffn_ratio_zero_and_ratios_sum_to_one(zeroed_ffn_run, method):
    ckpt = zeroed_ffn_run / "checkpoints" / "last.ckpt"
    result = contribution(str(ckpt), method, sequences=12, batch_size=4, clusters=16, probe_steps=15, restarts=2)
    assert result["labels"] == ["00.embed", "01.mha0", "02.ffn0", "03.mha1", "04.ffn1"]
    assert result["tokens"] == 12 * T
    values = result["values"]
    assert values[2] == values[1] and values[4] == values[3]  # identical states, identical measure
    assert result["ratio_ffn"] == 0.0 and result["ratio_mha"] == 1.0
    if method == "logit_lens":
        assert values[-1] > values[0]  # the trained layers predict better than the embeddings
        assert result["dla"]["02.ffn0"] == 0.0
    if method == "mi":
        assert all(0 <= v <= result["token_entropy_bits"] + 1e-9 for v in values)


def test_mi_averages_each_sites_information_over_its_k_means_seeds_and_bootstraps_the_ratios_se_over_them(
        zeroed_ffn_run):
    """--restarts k: each site's information is the mean of the k single-seed clusterings (seed, seed + 1, ...),
    each equal to a one-restart run at that seed, and the ratios get an SE over those seeds (one restart: none)."""
    ckpt = str(zeroed_ffn_run / "checkpoints" / "last.ckpt")
    options = dict(sequences=12, batch_size=4, clusters=16)
    singles = [contribution(ckpt, "mi", seed=7 + r, restarts=1, **options) for r in range(2)]
    pooled = contribution(ckpt, "mi", seed=7, restarts=2, **options)
    assert pooled["values_per_restart"] == [list(v) for v in zip(*(s["values"] for s in singles))]
    assert pooled["values"] == pytest.approx([sum(v) / 2 for v in zip(*(s["values"] for s in singles))], abs=1e-12)
    assert all(s["ratio_mha_se"] is None for s in singles) and "2 k-means seeds" in pooled["se_method"]
    # zeroed FFNs: every clustering gives the FFN no gain, so the ratio is 1 in every resample (SE 0); a model whose
    # clusterings disagree has a positive SE (the mi rows of the published contribution runs, docs/results.md)
    assert pooled["ratio_mha"] == 1.0 and pooled["ratio_mha_se"] == 0.0


def test_the_ratio_se_over_columns_is_positive_when_the_columns_disagree_and_zero_when_they_agree():
    from callbacks.contribution import bootstrap_ratio_se

    tags = ["embed", "mha", "ffn"]
    agree = torch.tensor([[3.0] * 4, [3.2] * 4, [3.3] * 4], dtype=torch.float64)  # four k-means seeds, one answer
    disagree = torch.tensor([[3.0, 3.1, 3.0, 3.2], [3.2, 3.15, 3.3, 3.25], [3.3, 3.4, 3.35, 3.3]], dtype=torch.float64)
    assert bootstrap_ratio_se(tags, agree) == pytest.approx({"mha": 0.0, "ffn": 0.0}, abs=1e-12)
    se = bootstrap_ratio_se(tags, disagree)
    assert se["mha"] > 0.05 and se["mha"] == pytest.approx(se["ffn"])  # the two ratios sum to 1
    assert bootstrap_ratio_se(tags, disagree[:, :1]) == {"mha": None, "ffn": None}


def test_cli_writes_json_and_prints_it(zeroed_ffn_run, tmp_path, capsys):
    ckpt = zeroed_ffn_run / "checkpoints" / "last.ckpt"
    out = tmp_path / "mi.json"
    main(["contribution", "--ckpt", str(ckpt), "--method", "mi", "--sequences", "8", "--clusters", "8",
          "--restarts", "2", "--json", str(out)])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == printed
    assert printed["method"] == "mi" and printed["clusters"] == 8 and printed["ratio_ffn"] == 0.0
    default = main(["contribution", "--ckpt", str(ckpt), "--sequences", "4"])
    assert (zeroed_ffn_run / "contribution-logit_lens.json").is_file() and default["method"] == "logit_lens"


def test_bad_input_names_the_option(zeroed_ffn_run, tmp_path):
    ckpt = zeroed_ffn_run / "checkpoints" / "last.ckpt"
    with pytest.raises(FileNotFoundError, match="--ckpt"):
        contribution(str(tmp_path / "missing.ckpt"))
    with pytest.raises(ValueError, match="--method: unknown method 'x'"):
        contribution(str(ckpt), "x")
    with pytest.raises(ValueError, match="--clusters: must be a positive integer"):
        contribution(str(ckpt), "mi", clusters=0)
    with pytest.raises(ValueError, match="--restarts: must be a positive integer, got 0"):
        contribution(str(ckpt), "mi", restarts=0)
    with pytest.raises(SystemExit):
        main(["contribution", "--ckpt", str(ckpt), "--method", "nope"])


def test_mutual_information_by_hand():
    x = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    assert mutual_information(x, x) == pytest.approx(2.0)  # I(X; X) = H(X) = 2 bits
    assert mutual_information(np.zeros(8, dtype=int), x) == pytest.approx(0.0)
    assert mutual_information(np.array([0, 1] * 4), np.array([0, 0, 1, 1] * 2)) == pytest.approx(0.0)
    assert mutual_information(x // 2, x) == pytest.approx(1.0)


# ---------------------------------------------------------------------------- routing
@pytest.fixture(scope="module")
def routed_run(tmp_path_factory):
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    from callbacks.routing import RoutingStatistics
    from lightning_modules.lm import LanguageModelModule

    L.seed_everything(0, verbose=False)
    module = LanguageModelModule(model=dict(variant="moe", vocab_size=32, d_model=32, n_layer=3, n_head=2, block_size=16,
                                            moe={"num_experts": 4, "top_k": 1}), max_steps=4)
    logger = TensorBoardLogger(str(tmp_path_factory.mktemp("routing")), name="run")
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=logger, callbacks=[RoutingStatistics(every=2)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(torch.randint(0, 32, (32, 17)), batch_size=4))
    return pathlib.Path(logger.log_dir)


def test_routing_numbers_are_saved_per_logging_step_and_analyze_prints_first_vs_last(routed_run, capsys):
    records = [json.loads(line) for line in (routed_run / "routing" / "stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 3]
    assert [(t["source"], t["target"]) for t in records[0]["transitions"]] == [("layer0.moe", "layer1.moe"),
                                                                              ("layer1.moe", "layer2.moe")]
    result = main(["routing", str(routed_run)])
    err = capsys.readouterr().err
    assert "layer0.moe -> layer1.moe" in err and "first" in err and "(n=" in err
    counts = records[-1]["sites"]["layer0.moe"]["counts"]
    assert result["sites"]["layer0.moe"]["last"] == pytest.approx([c / sum(counts) for c in counts])
    link = records[0]["transitions"][0]["counts"]
    expected = [[v / sum(row) if sum(row) else 0.0 for v in row] for row in link]
    assert np.allclose(result["transitions"][0]["first"], expected)
    assert pathlib.Path(result["png"]).stat().st_size > 10_000


def test_routing_analysis_without_numbers_exits_2_naming_the_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.analyze", "routing", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "routing/stats.jsonl" in proc.stderr and "Traceback" not in proc.stderr


def test_routing_map_legend_names_each_option_and_heatmap_masks_unvisited_rows():
    from callbacks.routing import RoutingAccumulator, routing_map_figure, transition_figures
    from architectures.contract import RoutingSite

    def site(name, selected, choices, step):
        selected = torch.tensor(selected)[None, :, None]
        return RoutingSite(name=name, kind="token_choice", choice_names=choices, selected=selected,
                           weights=torch.ones(selected.shape), group="mom", step=step)

    trace = [site("mom.step0", [0, 1, 0, 2], ["attn1", "ffn1", "skip"], 0),
             site("mom.step1", [1, 1, 0, 0], ["attn1", "ffn2", "skip"], 1)]
    fig = routing_map_figure(trace)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["attn1", "ffn1", "ffn2", "skip / dropped"]  # one colour per option name, across rows
    acc = RoutingAccumulator()
    acc.add(trace)
    stats = acc.reduce()
    (heatmap,) = transition_figures(stats.transitions, stats.sites).values()
    ax = heatmap.axes[0]
    assert ax.get_xlabel() == "to: mom.step1" and ax.get_ylabel() == "from: mom.step0"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["attn1 (n=2)", "ffn1 (n=1)", "skip (n=1)"]
    assert len(heatmap.axes) == 2  # the heatmap and its colour bar
    assert ax.images[0].get_array().mask[2].all() == False  # noqa: E712 (row skip was visited)
    empty = site("mom.step0", [0, 0, 0, 0], ["attn1", "ffn1", "skip"], 0)
    acc.add([empty, trace[1]])
    (heatmap,) = transition_figures(acc.reduce().transitions, stats.sites).values()
    assert heatmap.axes[0].images[0].get_array().mask[1].all()  # ffn1 never chosen: masked, shown hatched
