"""Processes of the trainer: a checkpoint save starts no helper process. megatron's checkpoint
writer would otherwise start a multiprocessing Manager at the first save (a spawned server that
imports the saving process's __main__ and torch, ~3 s of CPU on the save's path and ~300 MB per
rank, never stopped); the saves are synchronous, so their write results stay in the process.
An entry point that skips the shutdown's garbage collections (processes.skip_exit_collection)
still runs its exit handlers and flushes what it wrote."""
import os
import subprocess
import sys

SAVE_TWICE = """
import os, sys
import torch
from megatron_rl import checkpoint
from megatron_rl.experiments.tiny_model import make_tiny_hf_checkpoint
from megatron_rl.models import ModelArgs
from megatron_rl.models.policy import Policy
from megatron_rl.parallel import ParallelConfig, init_distributed


def children():  # this process's child processes, started from any of its threads
    found = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            found += f.read().split()
    return found


if __name__ == "__main__":
    out = sys.argv[1]
    init_distributed(ParallelConfig())
    hf = make_tiny_hf_checkpoint(os.path.join(out, "hf"), "qwen2", seed=1)
    pol = Policy(ModelArgs.from_pretrained(hf), trainable=False)
    pol.load_hf(hf)
    before = children()
    for step in (1, 2):
        checkpoint.save_checkpoint(os.path.join(out, "run"), step, pol, with_optimizer=False)
    print("children before:", len(before), "after:", len(children()))
    loaded = Policy(ModelArgs.from_pretrained(hf), trainable=False)
    checkpoint.load_checkpoint(os.path.join(out, "run", "iter_0000002"), loaded,
                               with_optimizer=False)
    print("loaded equal:", all(torch.equal(a, b) for a, b in zip(pol.module.parameters(),
                                                                   loaded.module.parameters())))
"""


def test_saves_start_no_helper_process_and_load_back(tmp_path):
    main = tmp_path / "save_twice.py"
    main.write_text(SAVE_TWICE)
    out = subprocess.run([sys.executable, str(main), str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "children before: 0 after: 0" in out.stdout, out.stdout
    assert "loaded equal: True" in out.stdout, out.stdout


EXIT_AFTER_FREEZE = """
import atexit, sys
import torch
from megatron_rl.processes import skip_exit_collection

out = sys.argv[1]
log = open(out + "/unclosed.txt", "w")  # buffered, never closed: flushed at shutdown
log.write("written before the exit")
cycle = {"file": open(out + "/in_a_cycle.txt", "w")}
cycle["self"] = cycle  # unreachable after `del`: only a collection would free it
cycle["file"].write("x")
cycle["file"].flush()
del cycle
atexit.register(lambda: open(out + "/atexit.txt", "w").write("ran"))
skip_exit_collection()
print("frozen", flush=True)
"""


def test_skip_exit_collection_still_runs_exit_handlers_and_flushes_open_files(tmp_path):
    proc = subprocess.run([sys.executable, "-c", EXIT_AFTER_FREEZE, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "frozen"
    assert (tmp_path / "unclosed.txt").read_text() == "written before the exit"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "in_a_cycle.txt").read_text() == "x"  # what was flushed is kept
