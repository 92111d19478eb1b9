"""Hugging Face ``Trainer`` with ``--deepspeed``-style configs, run unchanged on DeepSpeed and on zeroplus.

``hf_trainer.py --deepspeed ds.json --output_dir DIR --out result.json``: a tiny Llama (grouped-query
attention) built from its config after the ``TrainingArguments`` (so ZeRO-3 builds it under
``zero.Init``), a fixed token dataset, 4 optimizer steps (micro-batch 2, accumulation 2, clipping,
the config's optimizer and schedule with their ``"auto"`` values filled by the Trainer), a checkpoint
every 2 steps; then a second Trainer on a fresh model resumes from ``checkpoint-2`` and trains steps
3-4 again. With ``--pretrained DIR`` the model comes from ``from_pretrained`` instead (under ZeRO-3:
into shards) and each parameter's sum, read through ``deepspeed.zero.GatheredParameters``, is kept.
Rank 0 writes each run's logged losses and gradient norms as JSON. ``--torch_compile``: the Trainer's
own flag (Accelerate then calls ``engine.compile()``); ``--no-resume`` skips the second Trainer.
``hf_trainer.py --jobs jobs.json``: several such runs in one launch (``script_jobs.py``).
``--lora``: the model is a PEFT LoRA model (rank 4 on every attention and MLP projection, the base
frozen): the Trainer then saves adapter checkpoints (``save_checkpoint(exclude_frozen_parameters=True)``,
``adapter_model.safetensors``) and resumes with ``load_checkpoint(load_module_strict=False)``.
``--qlora`` (with ``--pretrained``): the same over a 4-bit base (``from_pretrained`` with bitsandbytes'
NF4 ``BitsAndBytesConfig``, the model then in training mode as PEFT's QLoRA recipes leave it).
"""
import argparse
import json
import os

import deepspeed
import torch
from script_jobs import run_jobs
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments
from transformers.integrations.deepspeed import unset_hf_deepspeed_config
from transformers.trainer_pt_utils import get_model_param_count

SEQ, VOCAB, STEPS = 16, 128, 4


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(args) -> TrainingArguments:
    return TrainingArguments(output_dir=args.output_dir, deepspeed=args.deepspeed, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=3e-3, weight_decay=0.01,
                             warmup_steps=2, max_grad_norm=0.5, logging_steps=1, save_steps=2, save_strategy="steps",
                             report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_drop_last=True,
                             use_cpu=not torch.cuda.is_available(), torch_compile=args.torch_compile)


def model(pretrained: str | None = None, qlora: bool = False) -> torch.nn.Module:
    if qlora:  # a 4-bit base: bitsandbytes quantizes at load (not under zero.Init)
        from transformers import BitsAndBytesConfig
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=torch.float32)
        return AutoModelForCausalLM.from_pretrained(pretrained, quantization_config=quantization).train()
    if pretrained is not None:  # under ZeRO-3 read into shards (zero.Init + GatheredParameters per module)
        return AutoModelForCausalLM.from_pretrained(pretrained)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return AutoModelForCausalLM.from_config(config)


def with_lora(base: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)  # the adapters' initial values, the same on every rank and engine
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(base, config)


def checksums(module: torch.nn.Module) -> dict:
    """Each parameter's float64 sum, gathered (DeepSpeed's way of reading ZeRO-3 parameters whole)."""
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {n: p.detach().double().sum().item() for n, p in module.named_parameters()}


def logged(trainer: Trainer) -> dict:
    rows = [r for r in trainer.state.log_history if "loss" in r]
    return {"steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows],
            "grad_norm": [float(r["grad_norm"]) for r in rows]}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--pretrained", default=None, help="start from this saved model (from_pretrained)")
    parser.add_argument("--torch_compile", action="store_true")
    parser.add_argument("--no-resume", action="store_true")
    parser.add_argument("--resume-only", default=None, help="no first run: resume from this checkpoint-N (another "
                                                            "run's, DeepSpeed's too)")
    parser.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter on the frozen model")
    parser.add_argument("--qlora", action="store_true", help="--lora over a 4-bit base (needs --pretrained)")
    return parser


def job(args: argparse.Namespace) -> None:
    unset_hf_deepspeed_config()  # an earlier job's ZeRO-3 left on would build the reference below partitioned
    expected, loaded, whole_count = {}, {}, None
    if args.pretrained:  # saved from a model built whole, before the TrainingArguments turn ZeRO-3 on
        reference = model()
        expected = {n: p.detach().double().sum().item() for n, p in reference.named_parameters()}
        whole_count = sum(p.numel() for p in reference.parameters())
        if int(os.environ.get("RANK", "0")) == 0:
            reference.save_pretrained(args.pretrained)
    training_args = arguments(args)  # before the model: under ZeRO-3 it is built under zero.Init
    deepspeed.init_distributed()  # on a CPU (use_cpu) the Trainer leaves DeepSpeed's comm to initialize()
    if args.pretrained:
        torch.distributed.barrier()
    first_model = model(args.pretrained, args.qlora)
    if args.pretrained and not args.qlora:
        loaded = checksums(first_model)
    if args.lora or args.qlora:
        first_model = with_lora(first_model)
    first, facts = None, {}
    if args.resume_only is None:
        trainer = Trainer(model=first_model, args=training_args, train_dataset=Tokens())
        trainer.train()
        first = logged(trainer)
        engine = trainer.model_wrapped
        facts = {"engine": type(engine).__module__, "stage": engine.zero_optimization_stage(),
                 "checkpoints": sorted(os.listdir(args.output_dir)),
                 "compiled": bool(getattr(engine, "is_compiled", False)),
                 # what the Trainer logs as the model's size (through ds_numel under ZeRO-3), and the whole model's
                 "param_counts": [get_model_param_count(first_model), get_model_param_count(first_model, True)],
                 "whole_count": whole_count}
    if not args.no_resume:
        training_args = arguments(args)
        again = model(args.pretrained, args.qlora)
        again = with_lora(again) if args.lora or args.qlora else again
        trainer = Trainer(model=again, args=training_args, train_dataset=Tokens())
        trainer.train(resume_from_checkpoint=args.resume_only or os.path.join(args.output_dir, "checkpoint-2"))
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"first": first, "resumed": logged(trainer), "expected": expected, "loaded": loaded,
                       **facts}, f)


def main() -> None:
    run_jobs(parser(), job)
    torch.distributed.destroy_process_group()  # a gloo group left to the interpreter's exit may abort it


if __name__ == "__main__":
    main()
