"""TrainConfig: flags, help, checks, and which behaviour-policy log-probs the trainer uses."""
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
    assert parse_config(BASE + ["--rollout-engine", "sglang", "--weight-sync", "distributed",
                                "--rollout-gpus", "1"]).rollout.weight_sync == "distributed"
    assert parse_config(BASE + ["--rollout-engine", "vllm", "--weight-sync",
                                "tensor"]).rollout.weight_sync == "tensor"
    with pytest.raises(ValueError, match="--weight-sync distributed: --rollout-engine vllm takes auto, disk, tensor"):
        parse_config(BASE + ["--rollout-engine", "vllm", "--weight-sync", "distributed"])
    with pytest.raises(ValueError, match="--rollout-engine process takes auto, disk, tensor"):
        parse_config(BASE + ["--rollout-engine", "process", "--weight-sync", "distributed"])
    with pytest.raises(ValueError, match="--rollout-url needs --rollout-engine vllm or sglang"):
        parse_config(BASE + ["--rollout-engine", "process", "--rollout-url", "http://x:1"])
    assert parse_config(BASE + ["--rollout-process-cores", "1", "2"]
                        ).rollout.rollout_process_cores == [1, 2]


def test_server_devices_are_checked():
    """--rollout-gpus: one device per started server, each its own; --weight-sync distributed
    (NCCL from training rank 0, on device 0) never with a server on device 0."""
    sglang = BASE + ["--rollout-engine", "sglang"]
    assert parse_config(sglang + ["--rollout-num-servers", "3"]).rollout.server_gpus() == [0, 1, 2]
    assert parse_config(sglang + ["--rollout-num-servers", "2", "--rollout-gpus", "5", "4"]
                        ).rollout.server_gpus() == [5, 4]
    for gpus in (["1"], ["1", "1"], ["1", "-1"]):
        with pytest.raises(ValueError, match="one device index .* per server, a different one"):
            parse_config(sglang + ["--rollout-num-servers", "2", "--rollout-gpus", *gpus])
    with pytest.raises(ValueError, match="--rollout-gpus places servers started here"):
        parse_config(BASE + ["--rollout-engine", "process", "--rollout-gpus", "1"])
    with pytest.raises(ValueError, match="--rollout-gpus places servers started here"):
        parse_config(sglang + ["--rollout-url", "http://x:1", "--rollout-gpus", "1"])
    with pytest.raises(ValueError, match="NCCL, which refuses two members of one group on one "
                                         "GPU; a server started here runs on device 0"):
        parse_config(sglang + ["--weight-sync", "distributed"])
    with pytest.raises(ValueError, match=r"runs on device 0 \(--rollout-gpus 1 0\)"):
        parse_config(sglang + ["--weight-sync", "distributed", "--rollout-num-servers", "2",
                               "--rollout-gpus", "1", "0"])
    parse_config(sglang + ["--weight-sync", "distributed", "--rollout-url", "http://x:1"])
    with pytest.raises(ValueError, match="--rollout-gpu-memory-utilization 1.5: a share"):
        parse_config(sglang + ["--rollout-gpu-memory-utilization", "1.5"])


def test_grouped_config_keeps_flat_flags():
    """Each flag lands in its group once; --help groups them; YAML keys are the flag names."""
    from megatron_rl.config import TrainConfig
    from megatron_rl.flags import flag_fields, to_flat_dict

    cfg = parse_config(BASE + ["--kl-estimator", "k3", "--loss-aggregation", "seq-mean-token-mean",
                               "--sequence-parallel", "--tensor-model-parallel-size", "2",
                               "--lr-decay-style", "cosine", "--train-iters", "10",
                               "--ppo-minibatches", "2", "--recompute-granularity", "selective"])
    assert cfg.loss.kl.estimator == "k3" and cfg.loss.aggregation == "seq-mean-token-mean"
    assert cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.optimizer.lr_decay_iters == 20  # optimizer steps: train iters x minibatches
    assert cfg.model.options.recompute_granularity == "selective"
    flat = to_flat_dict(cfg)
    assert set(flat) == set(flag_fields(TrainConfig)) and flat["kl_estimator"] == "k3"


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


def test_every_flag_has_help_beyond_its_default():
    """Each flag of `megatron-rl train` says what it does, not only its default; the help is
    declared once, with the field."""
    import re

    from megatron_rl.config import TrainConfig, build_parser
    from megatron_rl.flags import flag_fields

    parser = build_parser()
    flags = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    assert set(flags) == set(flag_fields(TrainConfig))
    for name, action in flags.items():
        text = re.sub(r"\s*\(?default: [^()]*\)?$", "", action.help or "")
        assert len(text.split()) >= 3, f"--{name.replace('_', '-')}: no help ({action.help!r})"
    parser.format_help()  # every help string survives argparse's %-formatting


def test_declared_minimums_and_layout_checks():
    with pytest.raises(ValueError, match="--group-size 0: must be >= 1"):
        parse_config(BASE + ["--group-size", "0"])
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 0: must be >= 1"):
        parse_config(BASE + ["--tensor-model-parallel-size", "0"])
    with pytest.raises(ValueError, match="--sequence-parallel needs --tensor-model-parallel-size"):
        parse_config(BASE + ["--sequence-parallel"])
    cfg = parse_config(BASE + ["--num-prompts-per-step", "8", "--ppo-minibatches", "2"])
    cfg.check_layout(2)
    with pytest.raises(ValueError, match="--num-prompts-per-step 8 must be divisible by "
                                         "data-parallel size 3 x --ppo-minibatches 2"):
        cfg.check_layout(3)
    # pipeline parallelism without packing: every microbatch of one shape
    cfg = parse_config(BASE + ["--num-prompts-per-step", "4", "--group-size", "5",
                               "--micro-batch-size", "8", "--pipeline-model-parallel-size", "2",
                               "--no-sequence-packing"])
    with pytest.raises(ValueError, match="--micro-batch-size 8 must divide the 20 sequences"):
        cfg.check_layout(1)
    cfg.algorithm.sequence_packing = True
    cfg.check_layout(1)


def test_config_file_keys_no_setting_reads_are_ignored(tmp_path):
    """A run's config.json may hold a key of a setting that was never read: it loads (with a
    warning) to the same configuration; other unknown keys are errors."""
    from megatron_rl.flags import to_flat_dict

    old = tmp_path / "config.yaml"
    old.write_text("log_interval: 1\nkl_coef: 0.1\n")
    with pytest.warns(UserWarning, match=r"ignoring \['log_interval'\]"):
        cfg = parse_config(["--config", str(old)] + BASE)
    assert to_flat_dict(cfg) == to_flat_dict(parse_config(BASE + ["--kl-coef", "0.1"]))
    old.write_text("log_intervals: 1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        parse_config(["--config", str(old)] + BASE)


def test_routing_replay_is_checked():
    """--routing-replay: an engine that returns routes, no activation recompute, and the local
    engine at PP 1 only."""
    for engine in ("local", "process", "sglang"):
        assert parse_config(BASE + ["--routing-replay", "--rollout-engine", engine]
                            ).algorithm.routing_replay
    with pytest.raises(ValueError, match="--rollout-engine vllm does not"):
        parse_config(BASE + ["--routing-replay", "--rollout-engine", "vllm"])
    with pytest.raises(ValueError, match="--recompute-granularity"):
        parse_config(BASE + ["--routing-replay", "--recompute-granularity", "selective"])
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 1"):
        parse_config(BASE + ["--routing-replay", "--pipeline-model-parallel-size", "2"])
    parse_config(BASE + ["--routing-replay", "--pipeline-model-parallel-size", "2",
                         "--rollout-engine", "process"])


def test_sampling_values_are_checked_naming_the_flag():
    """--temperature >= 0 (0: greedy, as every engine does), --top-p in (0, 1]."""
    for flags, message in ((["--temperature", "-1"], "--temperature -1.0: must be >= 0"),
                           (["--temperature", "nan"], "--temperature nan"),
                           (["--top-p", "1.5"], r"--top-p 1.5: a probability mass in \(0, 1\]"),
                           (["--top-p", "0"], r"--top-p 0.0: a probability mass in \(0, 1\]")):
        with pytest.raises(ValueError, match=message):
            parse_config(BASE + flags)
    assert parse_config(BASE + ["--temperature", "0"]).rollout.temperature == 0.0
    assert parse_config(BASE + ["--top-p", "1"]).rollout.top_p == 1.0


def test_group_baselines_need_two_responses_per_prompt():
    for estimator in ("rloo", "grpo", "dr_grpo"):
        with pytest.raises(ValueError, match=f"--group-size 1 with --advantage-estimator "
                                             f"{estimator}: .* needs --group-size >= 2"):
            parse_config(BASE + ["--group-size", "1", "--advantage-estimator", estimator])
    parse_config(BASE + ["--group-size", "1", "--advantage-estimator", "reinforce"])


def test_config_file_values_take_the_settings_types(tmp_path):
    """PyYAML reads `3e-4` (no dot) and `"5"` as strings: they become the declared float and
    int; a value that is not the setting's type is refused naming the key and the file."""
    f = tmp_path / "run.yaml"
    f.write_text('lr: 3e-4\ngroup_size: "5"\nkl_coef: 1\ntrain_data: d.jsonl\n'
                 'rollout_process_cores: ["1", 2]\nrollout_url: null\nref_checkpoint: null\n')
    cfg = parse_config(["--config", str(f), "--hf-checkpoint", "m"])
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.algorithm.group_size == 5 and isinstance(cfg.algorithm.group_size, int)
    assert cfg.loss.kl.coef == 1.0 and isinstance(cfg.loss.kl.coef, float)
    assert cfg.data.train_data == ["d.jsonl"]
    assert cfg.rollout.rollout_process_cores == [1, 2]
    assert cfg.rollout.rollout_url == [] and cfg.model.ref_checkpoint is None
    for text, message in (('group_size: "five"', r"group_size: 'five' is not int \(the type of "
                                                  r"--group-size\)"),
                          ("group_size: 2.5", "group_size: 2.5 is not int"),
                          ("bf16: 'yes'", r"bf16: 'yes' is not bool \(the type of --bf16\)"),
                          ("lr: fast", "lr: 'fast' is not float"),
                          ("train_iters: null", "train_iters: null"),
                          ("[1, 2]", "not a mapping of setting names")):
        f.write_text(text + "\n")
        with pytest.raises(ValueError, match=f"{f}: {message}"):
            parse_config(["--config", str(f)] + BASE)


def test_a_runs_config_json_is_usable_as_config(tmp_path):
    """<save>/config.json (runtime.py: json.dump of to_flat_dict) read back with --config gives
    the same configuration: JSON writes 1e-08, which PyYAML reads as a string."""
    import json

    from megatron_rl.flags import to_flat_dict

    cfg = parse_config(BASE + ["--lr", "3e-5", "--clip-high", "inf", "--save", str(tmp_path)])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_flat_dict(cfg), indent=2))
    again = parse_config(["--config", str(path)])
    assert to_flat_dict(again) == to_flat_dict(cfg)
    assert again.optimizer.adam_eps == 1e-8


def test_rollout_function_is_resolved_when_the_config_is_read():
    """--rollout-function: the built-in by default, an import path from the command line or a
    YAML file; a path that does not import stops the run before anything is built, naming the
    flag and what is wrong."""
    assert parse_config(BASE).rollout.rollout_function == "single-turn"
    path = "megatron_rl.rollout.single_turn:single_turn"
    assert parse_config(BASE + ["--rollout-function", path]).rollout.rollout_function == path
    with pytest.raises(ValueError, match=r"--rollout-function 'no_such_agent_module:loop': "
                                         r"cannot import module 'no_such_agent_module'"):
        parse_config(BASE + ["--rollout-function", "no_such_agent_module:loop"])
    with pytest.raises(ValueError, match=r"--rollout-function 'megatron_rl.rollout.functions:"
                                         r"agent_loop': 'megatron_rl.rollout.functions' has no "
                                         r"attribute 'agent_loop'"):
        parse_config(BASE + ["--rollout-function", "megatron_rl.rollout.functions:agent_loop"])
    with pytest.raises(ValueError, match=r"--rollout-function 'multi_turn': neither a built-in"):
        parse_config(BASE + ["--rollout-function", "multi_turn"])


def _float_flags() -> dict[str, dict]:
    """{flag: its field's metadata} for every float setting of `megatron-rl train`."""
    import typing

    from megatron_rl.config import TrainConfig
    from megatron_rl.flags import flag_name, walk

    return {flag_name(name): meta for name, _, kind, meta in walk(TrainConfig)
            if float in (kind, *typing.get_args(kind))}


def test_every_float_flag_refuses_nan_and_inf_naming_it(tmp_path):
    """NaN passes every comparison a check makes (nan < 0 is False), so `--kl-coef nan` used to
    train with NaN rewards and `--lr inf` to crash at step 2: each float setting refuses NaN
    and infinity (but where inf means something: no upper clip) before any model is built,
    from the command line or a config file (YAML's .nan, .inf)."""
    from megatron_rl.errors import ConfigError

    flags = _float_flags()
    assert {"--lr", "--kl-coef", "--temperature", "--adam-beta2", "--clip-high"} <= set(flags)
    for flag, meta in flags.items():
        with pytest.raises(ConfigError, match=f"^{flag} nan: must be a finite number"):
            parse_config(BASE + [f"{flag}=nan"])
        if meta.get("inf"):
            parse_config(BASE + [f"{flag}=inf", "--rollout-correction", "tis",
                                 "--old-logprobs", "recompute"])
        else:
            with pytest.raises(ConfigError, match=f"^{flag} inf: must be a finite number"):
                parse_config(BASE + [f"{flag}=inf"])
    recipe = tmp_path / "recipe.yaml"
    for text, message in (("kl_coef: .nan", "--kl-coef nan"), ("lr: .inf", "--lr inf"),
                          ("temperature: inf", "--temperature inf")):
        recipe.write_text(text + "\n")
        with pytest.raises(ConfigError, match=f"^{message}: must be a finite number"):
            parse_config(BASE + ["--config", str(recipe)])


# A value outside the range of each float setting (extra flags it needs to be checked), refused
# naming the flag. Every float setting with a range is here (checked below).
OUT_OF_RANGE = {
    "--moe-aux-loss-coeff": ("-0.1", []),
    "--distributed-timeout-minutes": ("0", []),
    "--rank-wait-timeout-minutes": ("-1", []),
    "--rollout-gpu-memory-utilization": ("1.5", []),
    "--temperature": ("-0.5", []),
    "--top-p": ("1.5", []),
    "--clip-low": ("1.5", []),
    "--clip-high": ("-0.1", []),
    "--kl-coef": ("-0.05", []),
    "--kl-is-truncation": ("0", []),
    "--rollout-is-low": ("-1", ["--rollout-correction", "tis", "--old-logprobs", "recompute"]),
    "--rollout-is-high": ("0", ["--rollout-correction", "tis", "--old-logprobs", "recompute"]),
    "--clip-ratio-c": ("1", []),
    "--sapo-tau-pos": ("0", []),
    "--sapo-tau-neg": ("-1", []),
    "--overlong-penalty-factor": ("-1", []),
    "--lr": ("-1e-6", []),
    "--min-lr": ("1", []),  # above --lr
    "--weight-decay": ("-0.1", []),
    "--adam-beta1": ("1", []),
    "--adam-beta2": ("1.5", []),
    "--adam-eps": ("0", []),
    "--clip-grad": ("-1", []),
    "--lr-warmup-init": ("1", []),  # above --lr
    "--exit-duration-in-mins": ("-1", []),
    "--agent-env-timeout": ("0", ["--rollout-function", "agent"]),
    "--agent-max-env-failures": ("1.5", ["--rollout-function", "agent"]),
    "--agent-sandbox-time": ("0", ["--rollout-function", "agent", "--agent-tools", "python"]),
}
NO_RANGE = {"--entropy-coef"}  # any finite value is a setting (negative: an entropy penalty)


@pytest.mark.parametrize("flag", sorted(OUT_OF_RANGE))
def test_out_of_range_numbers_are_refused_naming_the_flag(flag):
    """`--adam-beta2 1.5` used to pass the configuration and fail only once the model and its
    optimizer were built; every float setting's range is checked when the configuration is
    read, before any model is built, naming the flag."""
    from megatron_rl.errors import ConfigError

    value, extra = OUT_OF_RANGE[flag]
    with pytest.raises(ConfigError, match=flag):
        parse_config(BASE + extra + [f"{flag}={value}"])


def test_every_float_setting_has_its_range_checked():
    assert set(_float_flags()) == set(OUT_OF_RANGE) | NO_RANGE


def test_a_config_file_is_read_as_utf8_with_or_without_a_bom_and_its_faults_named(tmp_path):
    """A UTF-8 byte-order mark (Windows editors write one) is skipped whatever the locale; a file
    that is missing, not UTF-8 or not YAML is refused naming the file and, where it has one,
    the line."""
    from megatron_rl.errors import ConfigError

    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"\xef\xbb\xbfkl_coef: 0.1\n")
    assert parse_config(BASE + ["--config", str(recipe)]).loss.kl.coef == 0.1
    recipe.write_bytes(b"kl_coef: 0.1\n# caf\xe9\n")  # Latin-1
    with pytest.raises(ConfigError, match=f"--config {recipe}:2: not UTF-8: byte 0xe9 at column 6"):
        parse_config(BASE + ["--config", str(recipe)])
    recipe.write_bytes("kl_coef: 0.1\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=f"--config {recipe}: UTF-16"):
        parse_config(BASE + ["--config", str(recipe)])
    recipe.write_text("kl_coef: [0.1\n")
    with pytest.raises(ConfigError, match=f"(?s)--config {recipe}: not valid YAML: .*line 2"):
        parse_config(BASE + ["--config", str(recipe)])
    with pytest.raises(ConfigError, match=f"--config {tmp_path / 'none.yaml'}: cannot be read"):
        parse_config(BASE + ["--config", str(tmp_path / "none.yaml")])
