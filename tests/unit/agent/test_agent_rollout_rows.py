"""What --save-rollouts writes of agent-loop episodes (megatron_rl.rollout.trajectory_log on the
trajectories of megatron_rl.agent.loop): the rows give back each episode token for token, with
the policy's turns and the tool's response as separate segments in their own text, the engine's
log-probs, the reward, the end reason and the counts; and they print readably. The policy is
test_agent_loop's scripted engine on the character tokenizer."""
import json

from test_agent_loop import CALL, _run, calculator_then_answer

from megatron_rl.rollout import trajectory_log as tl


def test_an_episode_row_is_the_trajectory_token_for_token(tokenizer, scorer, tmp_path, capsys):
    groups, _, codec = _run(tokenizer, scorer, calculator_then_answer, group_size=2,
                            prompts=("Q: 12*34", "Q: 34*12"))
    rows = tl.trajectory_rows(groups, _records(), tl.kept_special_tokens(codec), step=4,
                              kind="eval")
    path = str(tmp_path / "eval_step_000004.jsonl")
    assert tl.write_rows(path, rows)
    read = tl.read_rows(path)
    assert read == json.loads(json.dumps(rows)) and len(read) == 4
    for row, t in zip(read, [t for g in groups for t in g]):
        assert tl.response_of(row) == (t.response_ids, t.response_mask, t.rollout_logprobs)
        assert row["prompt_ids"] == t.prompt_ids
        assert row["prompt"] == tokenizer.decode(t.prompt_ids, skip_special_tokens=False)
        assert [s["source"] for s in row["segments"]] == ["policy", "environment", "policy"]
        assert [s["text"] for s in row["segments"]] == [
            CALL, "\n<tool_response>\n408\n</tool_response>\n", "The answer is 408.<eos>"]
        assert (row["reward"], row["reward_error"], row["finish_reason"], row["end"]) == (
            1.0, None, "stop", "answer")
        assert row["counts"] == t.metadata["counts"]
        assert row["environment_tokens"] == len(row["segments"][1]["ids"])
    assert [(r["uid"], r["group"], r["index"]) for r in read] == [
        ("eval:0", 0, 0), ("eval:0", 0, 1), ("eval:1", 1, 0), ("eval:1", 1, 1)]
    tl.main([path, "--index", "2"])
    out = capsys.readouterr().out
    assert "end answer" in out and "=== 2. environment (" in out
    assert "\n<tool_response>\n408\n</tool_response>\n" in out


def _records():
    from megatron_rl.data.prompts import PromptRecord

    return [PromptRecord(f"eval:{i}", p, "arithmetic", "408")
            for i, p in enumerate(("Q: 12*34", "Q: 34*12"))]
