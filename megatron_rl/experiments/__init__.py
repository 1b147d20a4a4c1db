"""Research and verification code built on the library: studies, sweeps, checks, demo helpers.

- toy.py             the exact KL-gradient study on a toy model (``megatron-rl toy``)
- sweep.py           the estimator x placement sweep of the paper's Table 1 and its verdicts
                     (tools/reproduce.py)
- parallel_check.py  one forward/backward under several TP x PP layouts, compared against
                     transformers (tools/parallel_demo.py, tests/distributed)
- sft.py             supervised warm-up that turns a random tiny model into a weak base model
                     (tools/cpu_demo.py)
- plots.py           training curves as PNG from metrics.jsonl (tools/plot_runs.py)
- tiny_model.py      tiny random HF checkpoints and a character tokenizer for tests and demos

Imports point one way only: these modules use the library (everything else in ``megatron_rl``),
and no library module imports this package (tests/unit/test_import_boundary.py checks it), so
the trainer, rollout engines and CLI never load research code.
"""
