"""A Lightning Fabric training loop, as Fabric's docs show it."""

import json
import os

import torch
from lightning_fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset


def main() -> dict:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    fabric = Fabric(
        accelerator="cpu",
        strategy="ddp",
        devices=local,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
    )
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    x = torch.randn(64, 8)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8))
    losses = []
    for _ in range(2):
        for inputs, target in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), target)
            fabric.backward(loss)
            optimizer.step()
            losses.append(round(loss.item(), 6))
    mean = fabric.all_reduce(torch.tensor(losses[-1]), reduce_op="mean")
    weights = [round(w, 5) for w in model.weight.flatten().tolist()]
    return {
        "rank": fabric.global_rank,
        "world": fabric.world_size,
        "losses": losses,
        "mean_last": round(mean.item(), 6),
        "weights": weights,
    }


if __name__ == "__main__":
    result = main()
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{result['rank']}.json"), "w") as out:
        json.dump(result, out)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
