"""Helpers shared by the rollout-server tests: trainer-side log-prob recompute, a big step, and
a fault-injecting HTTP proxy."""

import collections
import http.server
import json
import threading
import time
import urllib.request

import torch

from megatron_rl.rollout.mismatch import logprob_mismatch, pad_ragged

# vLLM's CPU attention supports head sizes 32, 64, ... (not the tiny default 16): 2 heads of 32.
TINY = dict(num_attention_heads=2, num_key_value_heads=1)
TOL = 1e-3  # max |logp_server - logp_trainer|, fp32 on both sides
PROMPTS = [[5, 17, 300, 42], [9, 100], [250, 7, 7, 7, 31, 64]]
CHAR_PROMPTS = [[5, 17, 30, 42], [9, 100], [25, 7, 7, 7, 31, 64]]  # the character vocabulary (128)


def make_policy(path, lr=3e-2):
    from megatron_rl.models.config import ModelArgs
    from megatron_rl.models.optim import OptimConfig
    from megatron_rl.models.policy import Policy
    from megatron_rl.parallel import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(1, 1))
    policy = Policy(ModelArgs.from_pretrained(path), trainable=True,
                    optim=OptimConfig(lr=lr, clip_grad=0.0))
    policy.load_hf(path)
    return policy


def _batch(prompts, completions):
    seqs = [list(p) + c.token_ids for p, row in zip(prompts, completions) for c in row]
    tokens = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s)
    return seqs, tokens


def trainer_logprobs(policy, prompts, completions):
    """The Policy's log-probs of each completion's tokens, as ragged rows."""
    seqs, tokens = _batch(prompts, completions)
    plens = [len(p) for p, row in zip(prompts, completions) for _ in row]
    lp = policy.token_logprobs(tokens, len(seqs))
    return [lp[i, plens[i] - 1:len(seqs[i]) - 1].tolist() for i in range(len(seqs))]


def mismatch(policy, completions, prompts=PROMPTS):
    """Server-vs-trainer log-prob mismatch of these completions."""
    rollout, mask = pad_ragged([c.rollout_logprobs for row in completions for c in row])
    trainer, _ = pad_ragged(trainer_logprobs(policy, prompts, completions))
    return logprob_mismatch(rollout, trainer, mask)


def train_step(policy, prompts, completions):
    """One optimizer step that raises the log-prob of the sampled responses (a big step)."""
    _, tokens = _batch(prompts, completions)

    def loss_fn(batch, logits):
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(
            -1, batch["tokens"][:, 1:].unsqueeze(-1)).squeeze(-1)
        return -lp.mean(), {}

    policy.forward_backward([{"tokens": tokens}], loss_fn)
    ok, _ = policy.step()
    assert ok


def check_prompts_sample_independently(engine, prompt, other):
    """A seeded call's prompts draw independent samples on `engine` (a real server):
    - copies of one prompt in one call ([A, B, A], n=4) get different samples;
    - the first tokens of two prompts of equal length in one call, sample j of each, agree no
      more often than independent draws from their distributions would (estimated from the
      same samples: sum_k f_A(k) f_B(k) matches per pair); one seed for every prompt makes
      them agree nearly always, as their next-token distributions are close.
    Returns (agreeing pairs, the number expected under independence)."""
    from megatron_rl.rollout.base import SamplingParams

    assert len(prompt) == len(other) and prompt != other
    out = engine.generate([prompt, other, prompt], n=4,
                          params=SamplingParams(max_new_tokens=8, seed=7))
    assert [c.token_ids for c in out[0]] != [c.token_ids for c in out[2]]
    n, agree, expected = 64, 0, 0.0
    for seed in (3, 11):
        a, b = engine.generate([prompt, other], n=n,
                               params=SamplingParams(max_new_tokens=1, seed=seed))
        first_a, first_b = [c.token_ids[0] for c in a], [c.token_ids[0] for c in b]
        agree += sum(x == y for x, y in zip(first_a, first_b))
        count_a, count_b = collections.Counter(first_a), collections.Counter(first_b)
        expected += sum(count_a[k] * count_b[k] for k in count_a) / n
    assert agree <= expected + 4 * expected ** 0.5 + 3, (agree, expected)
    return agree, expected


def _spoil(fault: str, body: bytes) -> bytes:
    if fault == "malformed":
        return body[:len(body) // 2]  # cut mid-JSON
    resp = json.loads(body)
    if fault == "fewer":
        resp["choices"] = resp["choices"][:-1]
    elif fault == "bad_ids":
        resp["choices"][0]["token_ids"][0] = 10 ** 6
    elif fault == "nan_logprob":
        resp["choices"][-1]["logprobs"]["token_logprobs"][-1] = float("nan")
    return json.dumps(resp).encode()


class FaultProxy:
    """HTTP proxy on a free local port in front of a real server; `faults` (a deque) spoils the
    next /v1/completions answers, one fault each: "malformed" (cut mid-JSON), "fewer" choices,
    "bad_ids" (a token id outside the vocabulary), "nan_logprob", "slow" (answers after
    `slow_seconds`), "none" (passes the answer through)."""

    def __init__(self, upstream: str, slow_seconds: float):
        self.upstream = upstream
        self.faults: collections.deque[str] = collections.deque()
        self.completions_requests = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length) if length else None
                req = urllib.request.Request(proxy.upstream + self.path, data=data, method=method,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as resp:
                    status, body = resp.status, resp.read()
                if self.path == "/v1/completions":
                    proxy.completions_requests += 1
                    fault = proxy.faults.popleft() if proxy.faults else None
                    if fault == "slow":
                        time.sleep(slow_seconds)
                    elif fault not in (None, "none"):
                        body = _spoil(fault, body)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (the timeout fault)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def hf_logprobs(path: str, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
    """log p(token t | tokens before it) under the HF model at `path` (transformers, fp32),
    for the tokens of each sequence from index `starts[i]` on."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq, start in zip(sequences, starts):
            ids = torch.tensor([seq])
            logp = model(ids).logits[0, :-1].float().log_softmax(-1)
            out.append(logp[start - 1:].gather(-1, ids[0, start:, None])[:, 0].tolist())
    return out
