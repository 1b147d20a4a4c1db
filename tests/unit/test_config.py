"""TrainConfig: which behaviour-policy log-probs the trainer uses (--old-logprobs)."""
import pytest

from megatron_rl.config import parse_config

BASE = ["--hf-checkpoint", "m", "--train-data", "d.jsonl"]


@pytest.mark.parametrize("flags, expected", [
    ([], True),                                          # local engine, fp32, T=1, top-p 1
    (["--temperature", "0.7"], False),                   # engine log-probs are of softmax(z/T)
    (["--top-p", "0.9"], False),                         # ... of the truncated distribution
    (["--bf16"], False),                                 # decode and train numerics differ
    (["--rollout-engine", "vllm"], False),               # another implementation's numerics
    (["--old-logprobs", "recompute"], False),
    (["--old-logprobs", "rollout", "--rollout-engine", "sglang"], True),
])
def test_auto_uses_engine_logprobs_only_where_they_are_the_policys(flags, expected):
    assert parse_config(BASE + flags).use_rollout_logprobs() is expected


def test_unknown_choice_is_refused():
    with pytest.raises(SystemExit):
        parse_config(BASE + ["--old-logprobs", "engine"])


def test_weight_sync_modes_are_checked_against_the_engine():
    assert parse_config(BASE + ["--rollout-engine", "sglang", "--weight-sync",
                                "distributed"]).rollout.weight_sync == "distributed"
    assert parse_config(BASE + ["--rollout-engine", "vllm", "--weight-sync",
                                "tensor"]).rollout.weight_sync == "tensor"
    with pytest.raises(ValueError, match="--weight-sync distributed is SGLang's"):
        parse_config(BASE + ["--rollout-engine", "vllm", "--weight-sync", "distributed"])
    with pytest.raises(ValueError, match="the process engine takes tensor"):
        parse_config(BASE + ["--rollout-engine", "process", "--weight-sync", "distributed"])
    with pytest.raises(ValueError, match="--rollout-url needs --rollout-engine vllm or sglang"):
        parse_config(BASE + ["--rollout-engine", "process", "--rollout-url", "http://x:1"])
    assert parse_config(BASE + ["--rollout-process-cores", "1", "2"]
                        ).rollout.rollout_process_cores == [1, 2]


def test_grouped_config_keeps_flat_flags():
    """Each flag lands in its group once; --help groups them; YAML keys are the flag names."""
    from megatron_rl.config import flag_fields, to_flat_dict

    cfg = parse_config(BASE + ["--kl-estimator", "k3", "--loss-aggregation", "seq-mean-token-mean",
                               "--sequence-parallel", "--tensor-model-parallel-size", "2",
                               "--lr-decay-style", "cosine", "--train-iters", "10",
                               "--ppo-minibatches", "2", "--recompute-granularity", "selective"])
    assert cfg.loss.kl.estimator == "k3" and cfg.loss.aggregation == "seq-mean-token-mean"
    assert cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.optimizer.lr_decay_iters == 20  # optimizer steps: train iters x minibatches
    assert cfg.model.options.recompute_granularity == "selective"
    flat = to_flat_dict(cfg)
    assert set(flat) == set(flag_fields()) and flat["kl_estimator"] == "k3"


def test_release_memory_is_checked():
    """--rollout-release-memory: a vLLM/SGLang server's GPU memory, freed around training."""
    with pytest.raises(ValueError, match="--rollout-engine is local"):
        parse_config(BASE + ["--rollout-release-memory"])
    with pytest.raises(ValueError, match="needs --async-level 0"):
        parse_config(BASE + ["--rollout-engine", "vllm", "--rollout-release-memory",
                             "--async-level", "1"])
    from megatron_rl.parallel import use_cuda

    if not use_cuda():
        with pytest.raises(ValueError, match="it needs GPUs"):
            parse_config(BASE + ["--rollout-engine", "sglang", "--rollout-release-memory"])
