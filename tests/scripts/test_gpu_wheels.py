"""The wheels carried to the GPU machine (scripts/gpu_wheels.txt, fetched by
scripts/gather_gpu_wheels.sh) against that machine's own packages
(scripts/gpu_machine_packages.txt), offline: their declared requirements come from
scripts/gpu_wheels_metadata.json, which the gather script writes from the wheels themselves."""
import importlib
import json
import os
import sys
import zipfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
gs = importlib.import_module("gpu_summary")


def _norm_pin(pin: str) -> str:
    name, version = pin.split("==")
    return f"{gs._norm(name)}=={version}"


def test_the_carried_wheels_fit_the_gpu_machine():
    """Every pin has its recorded metadata (at the pinned version), and every requirement and
    Requires-Python is met by the carried wheels or the machine's recorded packages."""
    pins = gs.read_pins(gs.WHEEL_PINS)
    with open(gs.WHEEL_METADATA) as f:
        wheels = json.load(f)
    assert {_norm_pin(p) for p in pins} == {f"{n}=={m['version']}" for n, m in wheels.items()}, \
        "scripts/gpu_wheels_metadata.json is stale: run scripts/gather_gpu_wheels.sh"
    python, machine = gs.machine_packages(gs.MACHINE_PACKAGES)
    assert python.startswith("3.12") and machine["torch"].startswith("2.11")
    problems, unverified = gs.requirement_problems(wheels, machine, python)
    assert problems == []
    for line in unverified:  # ranges on machine packages of unrecorded version: names it has
        dep = gs._norm(line.split(" needs ")[1].split("[")[0].split("<")[0].split(">")[0])
        assert dep in machine and machine[dep] is None, line


def test_requirement_problems_names_what_the_machine_does_not_meet():
    wheels = {"trl": {"name": "trl", "version": "1.16.0", "requires_python": ">=3.13",
                      "requires_dist": ["transformers>=4.56.2", "datasets>=4.7.0", "rich",
                                        "pandas>=2", "nosuchpkg", "typing; python_version<'3.5'",
                                        "peft; extra == 'peft'"]},
              "datasets": {"name": "datasets", "version": "4.6.0", "requires_python": "",
                           "requires_dist": []}}
    machine = {"transformers": "4.40.0", "rich": None, "pandas": None, "peft": "0.1"}
    problems, unverified = gs.requirement_problems(wheels, machine, "3.12.3")
    assert sorted(problems) == sorted([
        "trl 1.16.0 needs Python >=3.13; the machine has 3.12.3",
        "trl 1.16.0 needs transformers>=4.56.2; on the machine: transformers 4.40.0",
        "trl 1.16.0 needs datasets>=4.7.0; carried: datasets 4.6.0",
        "trl 1.16.0 needs nosuchpkg: neither carried nor on the GPU machine"])
    assert unverified == ["trl 1.16.0 needs pandas>=2: the machine's version is not recorded"]


def _wheel(folder, name, version, requires=()):
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
                   + [f"Requires-Dist: {r}\n" for r in requires]) + "\nA description.\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_check_wheels_folder(tmp_path):
    """A folder against the pins and the machine: two versions of one package, a pin missing,
    an unpinned wheel, a requirement the machine's torch does not meet, the size limit."""
    d = str(tmp_path)
    _wheel(d, "megatron_core", "0.16.1", ["torch>=3.0", "packaging"])
    _wheel(d, "dill", "0.4.0")
    _wheel(d, "dill", "0.3.9")
    machine = tmp_path / "machine.txt"
    machine.write_text("# a machine\npython==3.12.3\ntorch==2.11.0+cu130\npackaging\n")
    problems, unverified, total, rows, wheels = gs.check_wheels(
        d, limit_mib=total_mib(d) / 2, pins=["megatron-core==0.16.1", "dill==0.4.0", "trl==1.16.0"],
        machine_file=str(machine))
    assert len(rows) == 3 and set(wheels) == {"megatron-core", "dill"}
    assert any(p.startswith("dill: 2 versions") for p in problems)
    assert "trl==1.16.0 is pinned (scripts/gpu_wheels.txt) but not in " + d in problems
    assert f"dill==0.3.9 is in {d} but not pinned" in problems
    assert "megatron_core 0.16.1 needs torch>=3.0; on the machine: torch 2.11.0+cu130" in problems
    assert any("MiB of wheels >" in p for p in problems)
    assert unverified == []


def total_mib(folder) -> float:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**20
