"""megatron-rl: RL post-training of LLMs with correct KL regularization, on megatron-core."""

import sys as _sys
import warnings as _warnings

__version__ = "0.1.0"

# megatron-core announces at import time every optional accelerator it does not find (Apex,
# TransformerEngine); on CPU machines that is expected, so those notices are silenced here.
for _msg in (r".*Apex is not installed.*", r".*Transformer Engine and Apex are not installed.*",
             r".*full scope is deprecated.*", r".*Please use DTensor instead.*"):
    _warnings.filterwarnings("ignore", message=_msg)


class _MegatronImportHooks:
    """A meta-path finder for two costs megatron-core's import puts on every trainer process and
    torchrun rank, neither of which buys megatron-rl anything:

    - wandb: megatron-core imports it, when installed, at import time (for an inference
      engine's metrics), about 2 s of CPU; `import wandb` fails while the package megatron.core
      is being imported (megatron-core's imports of it are guarded by `except ImportError`).
      Any other import of wandb (megatron-rl's --wandb-project logger) is left alone.
    - torch.compile: megatron-core decorates its fusions with `megatron.core.jit.jit_fuser`
      (torch.compile), whose first use imports torch's compiler stack, about 2.5 s of CPU.
      Without CUDA megatron-rl turns every fusion off (models/config.fusion_availability), so
      there megatron.core.jit's `disable_jit_fuser()` runs right after that module loads,
      before any fusion is decorated; with CUDA nothing changes.
    """

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "wandb":
            core = _sys.modules.get("megatron.core")
            if getattr(getattr(core, "__spec__", None), "_initializing", False):
                raise ImportError("wandb is not imported while megatron.core is imported")
        if name == "megatron.core.jit":
            import importlib.machinery

            spec = importlib.machinery.PathFinder.find_spec(name, path)
            loader = getattr(spec, "loader", None)
            if loader is not None and hasattr(loader, "exec_module"):
                exec_module = loader.exec_module

                def exec_then_disable(module):
                    exec_module(module)
                    if not _sys.modules["torch"].cuda.is_available():
                        module.disable_jit_fuser()

                loader.exec_module = exec_then_disable
            return spec
        return None


_sys.meta_path.insert(0, _MegatronImportHooks)  # type: ignore[arg-type]
