"""Prompt lengths against the context a run can hold, checked when the data loads.

A sequence is a prompt and up to --max-new-tokens generated tokens, and it must fit the run's
context (rollout/factory.py context_limit: the model's max_position_embeddings, or
--rollout-max-context-len for servers started here). Every prompt a run may send is rendered
and tokenized once, when its data loads, as generation will tokenize it: a prompt too long is
named by its file and line before any model is built, not at the step that samples it. The
counts stay on the data set (PromptDataset.prompt_tokens) for what else needs the longest
prompt (the context length of the servers a run starts).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

from megatron_rl.data.prompts import PromptDataset
from megatron_rl.errors import UserError

log = logging.getLogger(__name__)

LISTED = 5  # offending rows named in a message
PROGRESS_ROWS = 10_000  # counting at least this many prompts shows progress
BATCH = 1024  # prompts per call of the tokenizer

Tokenize = Callable[[list[str]], Sequence[Sequence[int]]]  # texts -> their token ids


@dataclasses.dataclass(frozen=True)
class ContextLimit:
    """The tokens one sequence (a prompt and its response) may take: `tokens`, set by
    `source` as a user names it ("the model's max_position_embeddings (2048)",
    "--rollout-max-context-len 1024"); a response takes up to `max_new_tokens`."""

    tokens: int
    source: str
    max_new_tokens: int

    @property
    def max_prompt_tokens(self) -> int:
        return self.tokens - self.max_new_tokens


def count_prompt_tokens(data: PromptDataset, tokenize: Tokenize, first: int = 0) -> list[int]:
    """The token count of each rendered prompt of `data` (of its `first` rows in file order;
    0: all), by `tokenize` in batches of BATCH; progress shown from PROGRESS_ROWS prompts on."""
    from megatron_rl.progress import progress

    n = min(first, len(data)) if first else len(data)
    counts: list[int] = []
    shown = progress(range(n), desc=f"counting the tokens of {data.name}'s prompts",
                     unit="prompt", disable=n < PROGRESS_ROWS, every=max(n, 1))
    with shown:
        for start in range(0, n, BATCH):
            texts = [data.builder(ex) for ex in data.examples[start:min(start + BATCH, n)]]
            counts.extend(len(ids) for ids in tokenize(texts))
            shown.update(len(texts))
    return counts


def check_prompt_lengths(data: PromptDataset, tokenize: Tokenize, limit: ContextLimit, *,
                         what: str, skip: bool, first: int = 0) -> tuple[list[int], list[int]]:
    """(the rows of `data` to keep, the token counts of their first rows' prompts).

    Counts the prompts of `data` (its `first` rows in file order, 0: all; with `skip`, all of
    them, so that the first `first` rows kept are counted too). A prompt of more than
    limit.max_prompt_tokens tokens is refused: UserError (a ValueError) naming the first LISTED
    such rows (file:line and token count), how many there are, the limit and the flags that set
    it; or, with `skip` (--filter-overlong-prompts), left out with one warning. `what` names the
    data set in messages ("--train-data").
    """
    counts = count_prompt_tokens(data, tokenize, 0 if skip else first)
    most = limit.max_prompt_tokens
    over = [i for i, c in enumerate(counts) if c > most]
    if not over:
        return list(range(len(data))), counts
    named = ", ".join(f"{data.locations[i]} ({counts[i]} tokens)" for i in over[:LISTED])
    more = f" and {len(over) - LISTED} more" if len(over) > LISTED else ""
    rule = (f"a prompt's tokens + --max-new-tokens ({limit.max_new_tokens}) must fit "
            f"{limit.source}: at most {max(most, 0)} prompt tokens")
    if not skip or len(over) == len(data):
        raise_limit = (", raise --rollout-max-context-len" if "--rollout-max-context-len" in
                       limit.source else "")
        fix = (f"Shorten or remove these rows, lower --max-new-tokens{raise_limit}, or pass "
               "--filter-overlong-prompts to skip them" if not skip else
               f"--filter-overlong-prompts leaves none: lower --max-new-tokens{raise_limit}")
        raise UserError(f"{what}: {len(over)} of {len(counts)} prompts are too long ({rule}): "
                        f"{named}{more}. {fix}")
    log.warning("--filter-overlong-prompts: skipping %d of %d %s prompts (%s): %s%s",
                len(over), len(counts), what, rule,
                ", ".join(data.locations[i] for i in over[:LISTED]), more)
    skipped = set(over)
    kept = [i for i in range(len(data)) if i not in skipped]
    return kept, [counts[i] for i in kept]
