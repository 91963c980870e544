"""A PyTorch Lightning Trainer script (strategy="ddp" on CPUs), as Lightning's docs show it."""

import json
import os

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.losses.append(round(loss.item(), 6))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> dict:
    pl.seed_everything(0, verbose=False)
    x = torch.randn(64, 8)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = Regression()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=local,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8))
    weights = [round(w, 5) for w in model.layer.weight.flatten().tolist()]
    return {
        "rank": trainer.global_rank,
        "world": trainer.world_size,
        "losses": model.losses,
        "weights": weights,
    }


if __name__ == "__main__":
    result = main()
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{result['rank']}.json"), "w") as out:
        json.dump(result, out)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
