"""--deterministic-mode's environment (parallel.DETERMINISTIC_ENV) is in os.environ before the
first import of megatron.core: megatron-core imports TransformerEngine at its own import where
it is installed, and TransformerEngine reads NVTE_ALLOW_NONDETERMINISTIC_ALGO then.

Each entry point runs in a fresh interpreter with an import hook that records the environment
at the first import of megatron.core and stops there (nothing after it matters for what
TransformerEngine reads, and megatron-core's own import would take seconds)."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOOK = r'''
import importlib.abc, json, os, sys

from megatron_rl.parallel import DETERMINISTIC_ENV


class FirstImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("megatron.core", "transformer_engine"):
            print(json.dumps({"module": name,
                              "env": {k: os.environ.get(k) for k in DETERMINISTIC_ENV}}))
            sys.stdout.flush()
            os._exit(0)
        return None


for key in DETERMINISTIC_ENV:
    os.environ.pop(key, None)
sys.meta_path.insert(0, FirstImport())
'''

ENTRY_POINTS = {
    "init_distributed": '''
from megatron_rl.parallel import ParallelConfig, init_distributed
init_distributed(ParallelConfig(1, 1), deterministic=True)
''',
    "setup_run": '''
from megatron_rl.config import parse_config
from megatron_rl.runtime import setup_run
setup_run(parse_config(["--hf-checkpoint", "/nonexistent", "--train-data", "/nonexistent",
                        "--deterministic-mode"]))
''',
    "process_engine_child": '''
import multiprocessing
from megatron_rl.rollout.process import ProcessConfig, _serve
_serve(multiprocessing.Pipe()[0], ProcessConfig(hf_checkpoint="/nonexistent", work_dir="/tmp",
                                                deterministic=True))
''',
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_environment_set_before_megatron_core_is_imported(entry):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", HOOK + ENTRY_POINTS[entry]], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"megatron.core never imported:\n{proc.stdout}\n{proc.stderr}"
    seen = json.loads(lines[0])
    from megatron_rl.parallel import DETERMINISTIC_ENV

    assert seen["env"] == DETERMINISTIC_ENV, seen
