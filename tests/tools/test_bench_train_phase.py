"""tools/bench_train_phase.py's memory limit: on a GPU every worker may use the whole device
(the kit's sizes, Qwen2.5-0.5B's 24 layers at 4096-token responses, need more than a fixed
24 GiB of an 80 GiB H100); on a CPU the default stays 24 GiB, capped by the free memory."""
import importlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
btp = importlib.import_module("bench_train_phase")

GIB = 1 << 30
H100, H200 = 81559 << 20, 143771 << 20  # total memory as nvidia-smi reports them there


def test_default_limit_is_the_whole_gpu():
    default = btp.build_parser().parse_args([]).mem_limit_gib
    for total in (H100, H200):
        limit, note = btp.memory_limit(default, total, None)
        assert limit == total, note


def test_flag_caps_the_gpu_share_and_the_cpu_default_is_unchanged():
    assert btp.memory_limit(24.0, H100, None)[0] == 24 * GIB
    assert btp.memory_limit(200.0, H100, None)[0] == H100
    default = btp.build_parser().parse_args([]).mem_limit_gib
    assert btp.memory_limit(default, None, 100 * GIB) == (24 * GIB, "24 GiB")
    limit, note = btp.memory_limit(default, None, 10 * GIB)
    assert limit == 9 * GIB and "--mem-limit-gib 24 capped" in note
