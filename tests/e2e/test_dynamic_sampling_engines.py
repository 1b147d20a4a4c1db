"""--dynamic-sampling on a real run's engines (the tiny character model): which groups make the
batch, how far the data position moves, the bound on the rounds, and a resume under
--async-level. The rewards come from tests/e2e/spread_rollout.py, which gives reward spread to
the prompts "Calculate a+b." with a + b a multiple of 3 (21 of the 64)."""
import dataclasses

import pytest

from conftest import train_args
from spread_rollout import spread_of


def _run(model, data, tmp_path, extra=()):
    from megatron_rl.config import parse_config
    from megatron_rl.runtime import setup_run

    cfg = parse_config(train_args(model, data, str(tmp_path / "run"), 4,
                                  ["--rollout-function", "spread_rollout:by_sum",
                                   "--dynamic-sampling", *extra]))
    return setup_run(cfg)


def _prompts(run, texts):
    """The prompts' token ids (what the groups hold)."""
    return [run.codec.encode(t) for t in texts]


def _fresh(run):
    """The run's data at its start: the order the batches take their prompts in."""
    from megatron_rl.data.prompts import PromptDataset

    return PromptDataset(run.train_data.examples, run.train_data.builder,
                         seed=run.train_data.seed, name=run.train_data.name)


def test_the_batch_holds_the_first_groups_with_spread_and_the_data_moves_past_them(
        tiny_char_model, arithmetic_jsonl, tmp_path):
    from megatron_rl.dynamic_sampling import sample_informative
    from megatron_rl.rollout_queue import _local_round, batch_settings, generate_batch

    run = _run(tiny_char_model, arithmetic_jsonl, tmp_path, ["--no-dynamic-sampling-keep-kl"])
    try:
        order = [r.text for r in _fresh(run).next_batch(64)]
        with_spread = [i for i, t in enumerate(order) if spread_of(t)]
        # step 0: refilled until 4 groups with spread; exactly those, in data order; the data
        # position right after the 4th (the round's surplus goes back to the data)
        settings = batch_settings(run)
        assert settings.dynamic is not None
        s = sample_informative(settings.dynamic, run.train_data, _local_round(run, settings, 0))
        assert [g[0].prompt_ids for g in s.groups] == _prompts(
            run, [order[i] for i in with_spread[:4]])
        assert all(len(g) == 2 and g[0].reward != g[1].reward for g in s.groups)
        # each kept group's prompt record, for --save-rollouts
        assert [r.text for r in s.records] == [order[i] for i in with_spread[:4]]
        consumed = with_spread[3] + 1
        assert s.stats["rollout/consumed_prompts"] == consumed
        assert s.stats["rollout/filtered_groups"] == consumed - 4
        assert s.stats["rollout/generated_prompts"] >= consumed
        assert s.stats["rollout/dynamic_sampling_rounds"] >= 2 and not s.shortfall
        assert run.train_data.next_batch(1)[0].text == order[consumed]
        run.train_data.load_state_dict(s.data_state)
        # through the trainer's path: the next 4, the metrics logged, a batch of 4 x 2
        batch, metrics = generate_batch(run, 1)
        assert batch.num_sequences == 8 and metrics["rollout/batch_groups"] == 4
        rows = [batch.tokens[i, :batch.prompt_lengths[i]].tolist() for i in range(0, 8, 2)]
        assert rows == _prompts(run, [order[i] for i in with_spread[4:8]])
        assert metrics["rollout/consumed_prompts"] == with_spread[7] + 1 - consumed
        assert run.train_data.next_batch(1)[0].text == order[with_spread[7] + 1]
        # the bound: no refill round; the step warns and tops the batch up with the first
        # groups without spread
        run.train_data.load_state_dict(_fresh(run).state_dict())
        run.cfg.algorithm.dynamic_sampling_max_rounds = 0
        with pytest.warns(UserWarning, match=r"step 0: dynamic sampling found (\d) groups with "
                          r"reward spread of the 4 wanted .* in 1 rounds"):
            batch, metrics = generate_batch(run, 0)
        found = sum(spread_of(t) for t in order[:4])
        assert found < 4 and batch.num_sequences == 8
        assert metrics["rollout/consumed_prompts"] == 4
        assert metrics["rollout/dynamic_sampling_rounds"] == 1
    finally:
        run.close()


def test_keep_kl_trains_on_every_prompt_drawn_until_the_target(tiny_char_model,
                                                               arithmetic_jsonl, tmp_path):
    """With a KL term (K1 in the reward, the default) the groups without spread stay in the
    batch: the batch is the shortest prefix of the data with 4 groups with spread."""
    from megatron_rl.rollout_queue import generate_batch

    run = _run(tiny_char_model, arithmetic_jsonl, tmp_path)
    try:
        order = [r.text for r in _fresh(run).next_batch(64)]
        consumed = [i for i, t in enumerate(order) if spread_of(t)][3] + 1
        batch, metrics = generate_batch(run, 0)
        assert batch.num_sequences == 2 * consumed
        assert metrics["rollout/batch_groups"] == metrics["rollout/consumed_prompts"] == consumed
        assert run.train_data.next_batch(1)[0].text == order[consumed]
    finally:
        run.close()


def test_async_resume_continues_with_the_first_prompt_no_finished_batch_consumed(
        tiny_char_model, arithmetic_jsonl, tmp_path):
    """The process engine under --async-level 1 takes each batch's prompts in its background
    thread. The data position a checkpoint would save while the next batch is in flight is the
    one after the finished batches' prompts; a queue resumed from it generates the same next
    batch as the run that went on."""
    from megatron_rl.rollout_queue import RolloutQueue

    run = _run(tiny_char_model, arithmetic_jsonl, tmp_path,
               ["--rollout-engine", "process", "--async-level", "1",
                "--no-dynamic-sampling-keep-kl"])
    try:
        order = [r.text for r in _fresh(run).next_batch(64)]
        with_spread = [i for i, t in enumerate(order) if spread_of(t)]
        queue = RolloutQueue(run)
        first, _ = queue.take(0)
        second, _ = queue.take(1)  # step 2's batch is in flight now
        saved = queue.data_state() or run.train_data.state_dict()
        third, _ = queue.take(2)
        queue.close(wait=True)
        resumed_data = _fresh(run)
        resumed_data.load_state_dict(saved)
        assert resumed_data.next_batch(1)[0].text == order[with_spread[7] + 1]
        run.train_data.load_state_dict(saved)
        again = RolloutQueue(run)
        third_again, _ = again.take(2)
        again.close(wait=True)
        for a, b in zip(dataclasses.astuple(third), dataclasses.astuple(third_again)):
            assert a == b if not hasattr(a, "equal") else a.equal(b)
        # each batch the next 4 prompts with spread: none taken twice, none skipped
        for batch, part in ((first, 0), (second, 1), (third, 2)):
            rows = [batch.tokens[i, :batch.prompt_lengths[i]].tolist() for i in range(0, 8, 2)]
            assert rows == _prompts(run, [order[i] for i in with_spread[4 * part:4 * part + 4]])
    finally:
        run.close()
