"""SGLang's NCCL weight sync (--weight-sync distributed) under torchrun: trainer rank 0 hosts the
update group's rendezvous store, and a server worker joining it the way SGLang does
receives the broadcast, even with torchrun's TORCHELASTIC_USE_AGENT_STORE in the environment
(which makes torch's tcp:// rendezvous a client on every rank). gloo stands in for NCCL: the
store and group construction are the same."""
import os

import pytest

from megatron_rl.rollout.net import free_port

pytestmark = pytest.mark.distributed

WORKER = os.path.join(os.path.dirname(__file__), "update_group_worker.py")


def test_trainer_hosts_the_update_group_under_torchrun(torchrun):
    # a store nobody hosts fails within the 15 s store timeout, well inside torchrun's 120 s
    out = torchrun(2, [WORKER, str(free_port()), "15"], timeout=120)
    assert "RECEIVED mrl_weights_test_0 [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in out, out[-3000:]
    assert "RECEIVED mrl_weights_test_1 [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]" in out, out[-3000:]
