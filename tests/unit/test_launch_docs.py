"""docs/launch.md's SLURM job requeues into the same run: its --save does not depend on the
job (a requeued job has the same id, but a resubmitted one does not, and an id in the path
starts a new run either way), it requeues on the marker the trainer writes when it stops early
and saved, and SLURM signals the trainer in time to save."""
import re
from pathlib import Path

from megatron_rl.stopping import STOPPED_EARLY

DOC = Path(__file__).resolve().parents[2] / "docs" / "launch.md"


def _slurm_script() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    scripts = [b for b in blocks if "#SBATCH" in b]
    assert len(scripts) == 1, "docs/launch.md: expected one SLURM job script"
    return scripts[0]


def test_the_slurm_job_requeues_into_the_same_save():
    script = _slurm_script()
    save = re.search(r"^SAVE=(\S+)", script, re.M)
    assert save and "SLURM" not in save.group(1) and "$" not in save.group(1), save
    assert '--save "$SAVE"' in script
    assert f'[ -f "$SAVE/{STOPPED_EARLY}" ]' in script and "scontrol requeue" in script
    assert "#SBATCH --requeue" in script
    assert re.search(r"#SBATCH --signal=TERM@\d+", script)


def test_the_slurm_job_requeues_only_on_this_attempts_stop():
    """The marker is removed before the trainer starts: an attempt that fails before it
    could stop early (even one whose trainer never starts) is not requeued."""
    script = _slurm_script()
    remove = script.find(f'rm -f "$SAVE/{STOPPED_EARLY}"')
    assert 0 <= remove < script.find("srun "), "remove the marker before srun"


def test_each_launcher_gives_torchrun_time_to_save_and_torchrun_kills_first():
    """torchrun SIGKILLs its workers 30 s after it forwards a SIGTERM unless told otherwise, so
    every example that runs torchrun under a scheduler sets TORCH_ELASTIC_SHUTDOWN_TIMEOUT above
    30 s and within the time the scheduler gives (SLURM's early signal, Kubernetes' grace
    period), and makes torchrun the process the scheduler signals."""
    script = _slurm_script()
    lead = int(re.search(r"#SBATCH --signal=TERM@(\d+)", script).group(1))
    limit = int(re.search(r"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)", script).group(1))
    assert 30 < limit <= lead
    pods = [b for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
            if "terminationGracePeriodSeconds" in b]
    assert len(pods) == 1, "docs/launch.md: expected one Kubernetes example"
    grace = int(re.search(r"terminationGracePeriodSeconds: (\d+)", pods[0]).group(1))
    limit = int(re.search(r"name: TORCH_ELASTIC_SHUTDOWN_TIMEOUT.*\n\s*value: \"(\d+)\"",
                          pods[0]).group(1))
    assert 30 < limit < grace
    assert "exec torchrun" in pods[0]
