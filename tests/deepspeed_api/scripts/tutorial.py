"""A training script in the shape of DeepSpeed's tutorials, run unchanged on DeepSpeed and on zeroplus.

``torchrun --nproc-per-node 2 tutorial.py --deepspeed --deepspeed_config ds.json --out losses.json --ckpt DIR``:
argparse with ``deepspeed.add_config_arguments``, ``deepspeed.init_distributed()``, the model built
under ``deepspeed.zero.Init`` at stage 3, ``deepspeed.initialize`` returning the 4-tuple with a
dataloader of ``training_data``, the ``engine(batch)`` / ``engine.backward`` / ``engine.step`` loop,
``save_checkpoint`` with a client state after STEPS, then a second engine that
``load_checkpoint``s it and trains RESUMED more steps, and the first engine trains the same steps
for comparison. Rank 0 writes the losses as JSON.
"""
import argparse
import json

import deepspeed
import torch

STEPS, RESUMED, SEQ, VOCAB = 3, 2, 16, 128


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.block = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens[:, :-1])
        logits = self.head(self.norm(h + self.block(h)))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


def build(config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config,
                             enabled=config["zero_optimization"]["stage"] == 3):
        return TinyLM()


def engine_for(args, config: dict, data):
    model = build(config)
    return deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), training_data=data)


def train(engine, batches, steps: int) -> list:
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        loss = engine(next(batches))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    data = Rows(torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(1)))
    engine, optimizer, loader, scheduler = engine_for(args, config, data)
    batches = iter(loader)
    losses = train(engine, batches, STEPS)
    engine.save_checkpoint(args.ckpt, client_state={"seen": len(losses)})
    continued = train(engine, batches, RESUMED)
    resumed_engine, *_ = engine_for(args, config, data)
    path, client_state = resumed_engine.load_checkpoint(args.ckpt)
    assert client_state["seen"] == len(losses), client_state
    batches = iter(loader)
    for _ in range(client_state["seen"]):
        next(batches)
    resumed = train(resumed_engine, batches, RESUMED)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "continued": continued, "resumed": resumed, "lr": engine.get_lr(),
                       "engine": type(engine).__module__, "optimizer": type(optimizer).__name__,
                       "scheduler": type(scheduler).__name__, "stage": engine.zero_optimization_stage()}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
