"""A causal language model trained with HF transformers' Trainer, written the way HF's example
scripts are (argument dataclasses, HfArgumentParser, Trainer, metrics and state saved), with a
tiny Llama built from a config and random token blocks so that it needs no download. Nothing in it
knows zeropp: tests launch it unchanged, plain and through `python -m zpp_compile.launch`."""

from dataclasses import dataclass, field

import torch
import transformers
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed


@dataclass
class ModelArguments:
    hidden_size: int = field(default=32, metadata={"help": "the model's width"})
    num_hidden_layers: int = field(default=2, metadata={"help": "decoder layers"})
    vocab_size: int = field(default=61)


@dataclass
class DataTrainingArguments:
    block_size: int = field(default=16, metadata={"help": "tokens per training sample"})
    num_samples: int = field(default=32)


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    set_seed(training_args.seed)
    config = LlamaConfig(vocab_size=model_args.vocab_size, hidden_size=model_args.hidden_size,
                         intermediate_size=model_args.hidden_size * 9 // 4,
                         num_hidden_layers=model_args.num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=data_args.block_size, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, config.vocab_size, (data_args.num_samples, data_args.block_size), generator=generator)
    train_dataset = [{"input_ids": row, "labels": row} for row in blocks]
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset,
                      data_collator=transformers.default_data_collator)
    train_result = trainer.train()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    trainer.save_state()


if __name__ == "__main__":
    main()
