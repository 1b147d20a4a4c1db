"""megatron-rl: RL post-training of LLMs with correct KL regularization, on megatron-core."""

import sys as _sys
import warnings as _warnings

__version__ = "0.1.0"

# megatron-core announces at import time every optional accelerator it does not find (Apex,
# TransformerEngine); on CPU machines that is expected, so those notices are silenced here.
for _msg in (r".*Apex is not installed.*", r".*Transformer Engine and Apex are not installed.*",
             r".*full scope is deprecated.*", r".*Please use DTensor instead.*"):
    _warnings.filterwarnings("ignore", message=_msg)


class _NoWandbDuringMegatronImport:
    """A meta-path finder that makes `import wandb` fail while the package megatron.core is
    being imported. megatron-core imports wandb, when installed, at import time (for an
    inference engine's metrics that megatron-rl does not use), which costs every trainer
    process and every torchrun rank about 2 s of CPU; its imports are guarded by `except
    ImportError`. Any other import of wandb (megatron-rl's own --wandb-project logger, or
    megatron-core's after its package is imported) is left alone."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "wandb":
            core = _sys.modules.get("megatron.core")
            if getattr(getattr(core, "__spec__", None), "_initializing", False):
                raise ImportError("wandb is not imported while megatron.core is imported")
        return None


_sys.meta_path.insert(0, _NoWandbDuringMegatronImport)  # type: ignore[arg-type]
