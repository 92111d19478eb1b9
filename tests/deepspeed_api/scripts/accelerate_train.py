"""An Accelerate training loop with ``DeepSpeedPlugin``, run unchanged on DeepSpeed and on zeroplus.

``accelerate_train.py --config ds.json --out result.json``: the plugin takes the JSON (its batch size
``"auto"``, filled from the dataloader by ``prepare``), a tiny Llama, a ``DummyOptim`` standing for the
config's optimizer, ``accelerator.prepare``, then ``accelerator.backward`` / ``optimizer.step`` /
``optimizer.zero_grad`` with ``accelerator.accumulate`` for 4 steps of 2 micro-batches. Rank 0 writes
the losses, the global gradient norms and whether any step was skipped.
"""
import argparse
import json

import torch
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from accelerate.utils import DummyOptim
from transformers import AutoModelForCausalLM, LlamaConfig

SEQ, VOCAB, STEPS, GAS = 16, 128, 4, 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    plugin = DeepSpeedPlugin(hf_ds_config=args.config, gradient_accumulation_steps=GAS, gradient_clipping=0.5)
    if not torch.cuda.is_available():  # on a CPU-only machine Accelerate's DeepSpeed path would count 1 process
        PartialState(cpu=True)
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=GAS)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(ids, batch_size=2)
    optimizer = DummyOptim(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms, skipped = [], [], []
    batches = iter(loader)
    for _ in range(STEPS * GAS):
        batch = next(batches)
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if accelerator.sync_gradients:
            norms.append(float(accelerator.deepspeed_engine_wrapped.get_global_grad_norm()))
            skipped.append(optimizer.step_was_skipped)
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "norms": norms, "skipped": skipped,
                       "engine": type(model).__module__}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
