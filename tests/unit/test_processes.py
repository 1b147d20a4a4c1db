"""Helper processes of the trainer: the checkpoint writer's queue server is spawned without the
trainer's modules (a spawned child imports its parent's __main__, for the trainer torch and
megatron-core: ~10 s of CPU and ~270 MB at the first save of every run and rank)."""
import subprocess
import sys

TRAINER_LIKE_MAIN = """
import torch  # the trainer's __main__ imports torch and megatron-core
from megatron_rl import runtime

if __name__ == "__main__":
    runtime._start_checkpoint_helper()
    pid = runtime._checkpoint_helper._process.pid
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read()
    print("helper maps libtorch:", "libtorch" in maps)
    runtime._stop_checkpoint_helper()
"""


def test_checkpoint_helper_does_not_import_the_trainers_modules(tmp_path):
    main = tmp_path / "trainer_like.py"
    main.write_text(TRAINER_LIKE_MAIN)
    out = subprocess.run([sys.executable, str(main)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "helper maps libtorch: False" in out.stdout, out.stdout
