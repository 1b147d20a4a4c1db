"""Disk weight exports (rollout/weight_sync.WeightExporter) killed mid-write: the next exporter
of the root (the next start) removes their temporaries, never a live export's nor anything
else."""
import os

import pytest

from megatron_rl.rollout.weight_sync import WeightExporter


def test_a_killed_exports_temporaries_are_removed_at_the_next_start_and_a_live_ones_kept(
        tiny_qwen2, tmp_path, start_stalled_writer):
    from megatron_rl.models import ModelArgs, hf_mapping

    root = tmp_path / "weights"
    root.mkdir()
    others = {"notes.txt": "mine", ".version-notes": "mine", "v000002.old.keep": "mine"}
    for name, text in others.items():
        (root / name).write_text(text)
    (root / "v000000").mkdir()  # a complete version: pruning's, not a temporary
    (root / "v000000" / "config.json").write_text("{}")

    proc = start_stalled_writer("export", root, tiny_qwen2)
    try:
        left = sorted(set(os.listdir(root)) - {"v000000", *others})
        assert any(n.startswith(".version-") for n in left)
        assert any(n.startswith(".tmp-v000001-") for n in left)
        WeightExporter(str(root))  # a start while the export is alive: its files are kept
        assert sorted(set(os.listdir(root)) - {"v000000", *others}) == left
    finally:
        proc.kill()
        proc.wait()
    with pytest.warns(UserWarning, match="removing .*a weight export that did not finish") as w:
        exporter = WeightExporter(str(root))
    assert all(os.path.join(str(root), n) in str(w[0].message)
               for n in left if n != ".export.lock")
    assert sorted(os.listdir(root)) == sorted(["v000000", *others])
    assert all((root / n).read_text() == t for n, t in others.items())
    exporter.export_state_dict(hf_mapping.load_hf_state_dict(tiny_qwen2),
                               ModelArgs.from_pretrained(tiny_qwen2), 1)
    assert sorted(os.listdir(root)) == sorted(["v000000", "v000001", *others])
