"""A launched inference server does not inherit what belongs to the trainer's own process:
torchrun's variables (with TORCHELASTIC_USE_AGENT_STORE its tensor-parallel workers' rendezvous
waits for a store nobody hosts) and the allocator's settings (expandable segments break vLLM's
sleep mode and SGLang's memory saver). A real process under ManagedServer, started in a trainer
environment as torchrun sets it, writes down the environment it was given."""
import json
import os
import sys

from megatron_rl.rollout.managed_server import ManagedServer

# what torch 2.13's torchrun sets in every worker (local_elastic_agent.py, multiprocessing/api.py)
TORCHRUN = {
    "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "2", "ROLE_NAME": "default", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "8",
    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": "/tmp/err.json",
}
ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
             "PYTORCH_ALLOC_CONF": "expandable_segments:True"}

# dump the environment next to the "model", then serve HTTP (the health check)
DUMP_AND_SERVE = ("import json, os, runpy, sys; "
                  "json.dump(dict(os.environ), open(os.path.join(sys.argv[1], 'env.json'), 'w')); "
                  "sys.argv = ['http.server', '--bind', sys.argv[2], sys.argv[3]]; "
                  "runpy.run_module('http.server', run_name='__main__')")


def _server(model_path, host, port):
    return [sys.executable, "-c", DUMP_AND_SERVE, model_path, host, str(port)]


def test_launched_server_gets_no_launcher_or_allocator_variables(tmp_path, monkeypatch):
    for k, v in {**TORCHRUN, **ALLOCATOR, "CUDA_VISIBLE_DEVICES": "2,3",
                 "NCCL_DEBUG": "INFO"}.items():
        monkeypatch.setenv(k, v)
    server = ManagedServer("env", _server, str(tmp_path), log_dir=str(tmp_path / "logs"),
                           env={"VLLM_SERVER_DEV_MODE": "1"}, health_path="/",
                           startup_timeout=60)
    try:
        server.start()
    finally:
        server.stop()
    with open(tmp_path / "env.json") as f:
        env = json.load(f)
    assert not set(TORCHRUN) & set(env), sorted(set(TORCHRUN) & set(env))
    assert not set(ALLOCATOR) & set(env), sorted(set(ALLOCATOR) & set(env))
    # the rest of the trainer's environment, and the engine's own settings, reach it
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # device indices mean the same devices
    assert env["NCCL_DEBUG"] == "INFO" and env["PATH"] == os.environ["PATH"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1"



# a server's worker forms its own process group as vLLM's and SGLang's tensor-parallel workers
# do (a tcp:// rendezvous on a port of its own, rank 0 of its world), then serves HTTP
GROUP_AND_SERVE = ("import datetime, runpy, socket, sys, torch.distributed as dist; "
                   "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; "
                   "s.close(); "
                   "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', "
                   "rank=0, world_size=1, timeout=datetime.timedelta(seconds=10)); "
                   "sys.argv = ['http.server', '--bind', sys.argv[1], sys.argv[2]]; "
                   "runpy.run_module('http.server', run_name='__main__')")


def test_launched_servers_own_process_group_forms_under_torchrun(tmp_path, monkeypatch):
    for k, v in TORCHRUN.items():
        monkeypatch.setenv(k, v)
    server = ManagedServer("group", lambda model_path, host, port: [
        sys.executable, "-c", GROUP_AND_SERVE, host, str(port)], str(tmp_path),
        log_dir=str(tmp_path / "logs"), health_path="/", startup_timeout=60)
    try:
        server.start()  # raises with the server's log if its rendezvous timed out
        assert server.healthy()
    finally:
        server.stop()
