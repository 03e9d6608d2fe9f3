"""``lightning_modules.steps`` reads only Lightning's public attributes, and agrees with Lightning's own rule
(its training loop's private ``_should_accumulate``, read here by the test only) on which batch completes an
optimisation step: with accumulation over 3 batches, epochs of 7 batches (a short last group) and 2 epochs."""
from __future__ import annotations

import lightning as L
import torch

from lightning_modules.steps import completes_step


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        loop = self.trainer.fit_loop.epoch_loop
        self.seen.append((completes_step(self.trainer), not loop._should_accumulate()))
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_completes_step_agrees_with_lightning_under_gradient_accumulation(one_thread):
    module = _Tiny()
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=3, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(torch.randn(7, 4), batch_size=1))
    ours = [c for c, _ in module.seen]
    assert ours == [lightning for _, lightning in module.seen]
    assert ours == [False, False, True, False, False, True, True] * 2  # the epoch's last batch steps too
    assert trainer.global_step == 6
