"""A Hugging Face Accelerate training loop, as Accelerate's docs show it."""

import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main() -> dict:
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    x = torch.randn(64, 8)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=8))
    losses = []
    for _ in range(2):
        for inputs, target in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), target)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(round(loss.item(), 6))
    gathered = accelerator.gather(torch.tensor([losses[-1]]))
    weights = [round(w, 5) for w in accelerator.unwrap_model(model).weight.flatten().tolist()]
    result = {
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "losses": losses,
        "gathered": [round(v, 6) for v in gathered.tolist()],
        "weights": weights,
    }
    return result


if __name__ == "__main__":
    result = main()
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{result['rank']}.json"), "w") as out:
        json.dump(result, out)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
