"""TRL's trainers with ``--deepspeed``-style configs, run unchanged on DeepSpeed and on zeroplus.

``trl_train.py --trainer sft|dpo --deepspeed ds.json --output_dir DIR --out result.json``: a tiny Qwen2
built from its config after the trainer's arguments (so ZeRO-3 builds it under ``zero.Init``), a
word-level tokenizer made here (no download), and a fixed data set of token words: SFT on plain
text, DPO on (prompt, chosen, rejected) triples with a reference model (a second model built the same
way, which TRL prepares as an engine without an optimizer: ``deepspeed.initialize(model, config)``,
with its own bucket sizes as dotted keys at ZeRO-3), GRPO on prompts, 4 sampled completions each of
at most 6 words, rewarded by how many of the first ten words they use (no reference model: beta 0).
4 optimizer steps (micro-batch 2, accumulation 2); rank 0 writes the logged losses (and DPO's and
GRPO's rewards) as JSON, and what the reference model became. ``trl_train.py --jobs jobs.json``: several
such runs in one launch (``script_jobs.py``).
"""
import argparse
import json

import deepspeed
import torch
from datasets import Dataset
from script_jobs import run_jobs
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

WORDS = [f"w{i}" for i in range(60)]
STEPS = 4


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def sentence(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


def data(kind: str) -> Dataset:
    g = torch.Generator().manual_seed(1)
    if kind == "sft":
        return Dataset.from_dict({"text": [sentence(g, 12) for _ in range(64)]})
    if kind == "grpo":
        return Dataset.from_dict({"prompt": [sentence(g, 6) for _ in range(64)]})
    rows = [(sentence(g, 6), " " + sentence(g, 5), " " + sentence(g, 5)) for _ in range(64)]
    return Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows],
                              "rejected": [r[2] for r in rows]})


def reward(completions: list[str], **kwargs) -> list[float]:
    """GRPO's reward: how many words of a completion are among the first ten."""
    return [float(sum(w in WORDS[:10] for w in c.split())) for c in completions]


def model(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["sft", "dpo", "grpo"], required=True)
    parser.add_argument("--deepspeed", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser


def job(args: argparse.Namespace) -> None:
    common = dict(output_dir=args.output_dir, deepspeed=args.deepspeed, per_device_train_batch_size=2,
                  gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-3, logging_steps=1,
                  save_strategy="no", report_to=[], seed=0, data_seed=0, disable_tqdm=True,
                  use_cpu=not torch.cuda.is_available(), bf16=False)
    tok = tokenizer()
    facts = {}
    if args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer
        training_args = SFTConfig(**common, max_length=16)
        deepspeed.init_distributed()
        trainer = SFTTrainer(model=model(len(tok)), args=training_args, train_dataset=data("sft"),
                             processing_class=tok)
    elif args.trainer == "grpo":
        from trl import GRPOConfig, GRPOTrainer
        training_args = GRPOConfig(**common, num_generations=4, max_completion_length=6, beta=0.0,
                                   generation_kwargs={"do_sample": True}, temperature=1.0)
        deepspeed.init_distributed()
        trainer = GRPOTrainer(model=model(len(tok)), reward_funcs=reward, args=training_args,
                              train_dataset=data("grpo"), processing_class=tok)
    else:
        from trl import DPOConfig, DPOTrainer
        training_args = DPOConfig(**common, max_length=16, beta=0.1)
        deepspeed.init_distributed()
        trainer = DPOTrainer(model=model(len(tok)), ref_model=model(len(tok)), args=training_args,
                             train_dataset=data("dpo"), processing_class=tok)
        ref = trainer.ref_model
        facts = {"ref_engine": type(ref).__module__ + "." + type(ref).__name__,
                 "ref_stage": ref.zero_optimization_stage() if hasattr(ref, "zero_optimization_stage") else None}
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    keys = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "reward")
    result = {k: [float(r[k]) for r in rows if k in r] for k in keys}
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({**result, **facts, "engine": type(trainer.model_wrapped).__module__}, f)


def main() -> None:
    run_jobs(parser(), job)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
