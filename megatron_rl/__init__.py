"""megatron-rl: RL post-training of LLMs with correct KL regularization, on megatron-core."""

import warnings as _warnings

__version__ = "0.1.0"

# megatron-core announces at import time every optional accelerator it does not find (Apex,
# TransformerEngine); on CPU machines that is expected, so those notices are silenced here.
for _msg in (r".*Apex is not installed.*", r".*Transformer Engine and Apex are not installed.*",
             r".*full scope is deprecated.*", r".*Please use DTensor instead.*"):
    _warnings.filterwarnings("ignore", message=_msg)
