"""``--init_from`` a checkpoint trained with another tokenizer: refused in strict mode, a warning otherwise."""
from __future__ import annotations

import pytest
import torch

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from model_tools.weights import load_initial_weights

SHAPE = dict(vocab_size=97, d_model=32, n_layer=2, n_head=2, block_size=32)


@pytest.fixture
def checkpoint(tmp_path):
    model = build_model(ModelConfig(variant="vanilla", **SHAPE))
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "datamodule": {"fingerprints": {"tokenizer": "bytes:1111"}}}, path)
    return str(path)


def test_another_tokenizer_is_refused_in_strict_mode(checkpoint):
    with pytest.raises(ConfigError, match="was trained with tokenizer bytes:1111, this run uses bpe:2222"):
        load_initial_weights(build_model(ModelConfig(variant="vanilla", **SHAPE)), checkpoint, strict=True,
                             tokenizer="bpe:2222")


def test_another_tokenizer_loads_with_a_warning_when_not_strict(checkpoint, capsys):
    load_initial_weights(build_model(ModelConfig(variant="vanilla", **SHAPE)), checkpoint, strict=False,
                         tokenizer="bpe:2222")
    err = capsys.readouterr().err
    assert "warning: init_from:" in err and "bytes:1111" in err and "bpe:2222" in err and "--init_strict false" in err


def test_the_same_tokenizer_loads_without_a_warning(checkpoint, capsys):
    load_initial_weights(build_model(ModelConfig(variant="vanilla", **SHAPE)), checkpoint, strict=False,
                         tokenizer="bytes:1111")
    assert "warning" not in capsys.readouterr().err
