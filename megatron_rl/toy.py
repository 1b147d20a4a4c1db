"""Exact gradient study of KL estimator configurations on a toy model (paper Sec. 3.3, Fig. 1).

Model. A_theta is a binary autoregressive policy over y in {0, 1}^T with
    p_t = P(y_t = 1 | y_<t) = sigmoid(a + b c_{t-1}),   c_0 = 0,  c_t = 2 y_t - 1 in {-1, +1},
so the first token depends on a alone and later tokens on the previous token's sign. The reference
B is the same model with (a~, b~); off-policy samples come from A_old, a perturbed copy of A_theta.
Parameters are float64 and the module gives per-token log-probs [K, N, T] for K parameter copies
(K = 1 for exact sums; K = num_trials for vectorized Monte Carlo, one copy per trial, so one
backward pass yields every trial's gradient).

Target. The true gradient of the sequence-level reverse KL,
    g* = grad_theta KL(A_theta || B) = E_A[(sum_t K1_t) grad log A_theta(y)],
computed two independent ways: exact enumeration of all 2^T sequences, and the Markov-chain
recursion below (KL = sum_t sum_c m_t(c) KL(Bern(p_c) || Bern(q_c)), m_t the law of c_{t-1}).

Estimators. Each configuration is run through the production code path: megatron_rl.loss
`build_advantages` -> `policy_loss_per_token` -> `aggregate_loss` (kl.py inside), with task
reward 0 and beta = 1, so the loss gradient is the KL-regularizer gradient alone. Choices:
- advantage estimator "reinforce" (no baseline). A leave-one-out baseline leaves the on-policy
  expectation unchanged, but off-policy with correction "none" E_old[grad log A_theta] != 0, so a
  baseline would change the expectation and make exact sums and Monte Carlo disagree; the reported
  variances are therefore those of the baseline-free estimator.
- aggregation "seq-mean-token-sum", so a loss of N sequences is the mean of the sequence-level
  objective (the paper's per-token normalization only divides by the constant T here).
- clipping disabled (clip_low = 1, clip_high = inf): only the KL estimator's bias is measured.
Exact expected gradients are sum_y w(y) grad loss(y), with w = A_theta(y) on-policy or A_old(y)
off-policy, obtained by weighting the per-token loss of all 2^T sequences before aggregation.

Closed forms (on-policy; s_t = grad log p(y_t | c_{t-1}), r_t = B/A per token, phi(c) = (1, c)).
The paper's eqs. 12/13/15/16 state the expected gradients of K1/K3 in loss/reward in general; they
are derived again here and specialised to this model (`closed_form_gradients`):
    E[grad, K1 in loss]   = E[sum_t s_t] = 0
    E[grad, K1 in reward] = E[(sum_t K1_t) S] = g*
    E[grad, K3 in loss]   = -E[sum_t r_t s_t] = sum_t sum_c m_t(c) (p_c - q_c) phi(c)
        since E_{y~p}[r s] = sum_y q(y) grad log p(y) = (q - p) phi(c): the gradient of the
        token-level forward KL(B || A_theta) at A_theta's prefixes, not of the reverse KL.
    E[grad, K3 in reward] = grad E[sum_t K3_t] - E[grad, K3 in loss] = g* - E[grad, K3 in loss]
        since E_A[K3_t | y_<t] = KL_t, so E_A[sum_t K3_t] = KL(A_theta || B).
    E[grad, K2 in loss]   = E[sum_t K1_t s_t] = sum_t sum_c m_t(c) p_c (1 - p_c)
                            (logit p_c - logit q_c) phi(c)  (immediate term of g* only)
    E[grad, K in reward+loss] = grad E[sum_t K_t]: g* for K1 and K3; for K2 the gradient of
        E[sum_t K2_t], which is not the KL.
Off-policy (samples from A_old; expectations checked by enumeration only): with correction "none"
or "token-is" every configuration is biased. For the reward placement the two coincide: the PPO
per-token ratio already is the token-level correction of anything inside the advantage. "seq-is"
reproduces each on-policy expectation exactly (so K1 reward, K1 and K3 reward+loss are unbiased)
at a higher variance; truncating its weights brings the bias back.
MC columns: bias^2 = |mean of the trials' gradients - g*|^2 (includes variance / num_trials of
noise), variance = trace of the covariance of one trial's N-sample gradient.
"""
import argparse
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from megatron_rl.kl import KLConfig
from megatron_rl.loss import LossConfig, aggregate_loss, build_advantages, policy_loss_per_token

DTYPE = torch.float64
UNBIASED_TOL = 1e-20
TRIAL_CHUNK = 20


class BinaryARPolicy(nn.Module):
    """p_t = sigmoid(a + b c_{t-1}), c_0 = 0, c_t = 2 y_t - 1; K independent parameter copies."""

    def __init__(self, a: float, b: float, num_copies: int = 1):
        super().__init__()
        self.a = nn.Parameter(torch.full((num_copies,), float(a), dtype=DTYPE))
        self.b = nn.Parameter(torch.full((num_copies,), float(b), dtype=DTYPE))

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """y [K, N, T] in {0, 1} -> logits of P(y_t = 1 | y_{t-1}), [K, N, T]."""
        prev = torch.cat([torch.zeros_like(y[..., :1]), 2 * y[..., :-1] - 1], dim=-1)
        return self.a[:, None, None] + self.b[:, None, None] * prev

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs log p(y_t | y_{t-1}), [K, N, T]; y is broadcast over copies if [1, N, T]."""
        # log P(y) = log sigmoid(+z) for y = 1 and log sigmoid(-z) for y = 0.
        return nn.functional.logsigmoid((2 * y - 1) * self.logits(y))

    @torch.no_grad()
    def sample(self, num_samples: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """[K, num_samples, seq_len] sequences, one batch per parameter copy."""
        num_copies = self.a.shape[0]
        y = torch.zeros(num_copies, num_samples, seq_len, dtype=DTYPE)
        prev = torch.zeros(num_copies, num_samples, dtype=DTYPE)
        for t in range(seq_len):
            p = torch.sigmoid(self.a[:, None] + self.b[:, None] * prev)
            u = torch.rand(num_copies, num_samples, dtype=DTYPE, generator=generator)
            y[..., t] = (u < p).to(DTYPE)
            prev = 2 * y[..., t] - 1
        return y


def all_sequences(seq_len: int) -> torch.Tensor:
    """All 2^T binary sequences, [1, 2^T, T] float64."""
    idx = torch.arange(2 ** seq_len)
    bits = (idx[:, None] >> torch.arange(seq_len - 1, -1, -1)) & 1
    return bits.to(DTYPE).unsqueeze(0)


# ---------------------------------------------------------------- closed forms (Markov recursion)

_STATES = torch.tensor([0.0, -1.0, 1.0], dtype=DTYPE)  # c_{t-1}: start, previous 0, previous 1


def _state_marginals(a, b, seq_len):
    """m_t over _STATES for t = 1..T ([T, 3]) and p_c ([3]) for scalar tensors a, b."""
    p = torch.sigmoid(a + b * _STATES)
    m = torch.tensor([1.0, 0.0, 0.0], dtype=DTYPE)
    rows = []
    for _ in range(seq_len):
        rows.append(m)
        p_one = (m * p).sum()
        m = torch.stack([torch.zeros((), dtype=DTYPE), 1 - p_one, p_one])
    return torch.stack(rows), p


def _bern_expect(p, fn):
    """E_{y ~ Bern(p)}[fn(y)] for fn of a {0., 1.} tensor."""
    return p * fn(torch.ones_like(p)) + (1 - p) * fn(torch.zeros_like(p))


def _token_expectation_grad(theta, ref, seq_len, token_fn, hold_marginals):
    """grad_(a,b) of sum_t sum_c m_t(c) token_fn(p_c, q_c); m_t held fixed if hold_marginals."""
    a = torch.tensor(theta[0], dtype=DTYPE, requires_grad=True)
    b = torch.tensor(theta[1], dtype=DTYPE, requires_grad=True)
    m, p = _state_marginals(a, b, seq_len)
    q = torch.sigmoid(ref[0] + ref[1] * _STATES)
    if hold_marginals:
        m = m.detach()
    value = (m * token_fn(p, q)).sum()
    return torch.stack(torch.autograd.grad(value, [a, b]))


def _kl_bern(p, q):
    return p * (p.log() - q.log()) + (1 - p) * ((1 - p).log() - (1 - q).log())


def _expected_k2(p, q):
    def k2_of(y):
        log_r = torch.where(y > 0, q.log() - p.log(), (1 - q).log() - (1 - p).log())
        return 0.5 * log_r.square()
    return _bern_expect(p, k2_of)


def true_gradient(theta, ref, seq_len) -> torch.Tensor:
    """g* = grad KL(A_theta || B) [2] by the Markov recursion (independent of enumeration)."""
    return _token_expectation_grad(theta, ref, seq_len, _kl_bern, hold_marginals=False)


def closed_form_gradients(theta, ref, seq_len) -> dict:
    """Expected gradients [2] of the on-policy configurations (beta = 1), keyed "k?/placement"."""
    g_star = true_gradient(theta, ref, seq_len)
    k3_loss = _token_expectation_grad(theta, ref, seq_len, _forward_ce, hold_marginals=True)
    k2_loss = _token_expectation_grad(theta, ref, seq_len, _kl_bern, hold_marginals=True)
    k2_total = _token_expectation_grad(theta, ref, seq_len, _expected_k2, hold_marginals=False)
    return {
        "k1/loss": torch.zeros(2, dtype=DTYPE), "k1/reward": g_star, "k1/reward+loss": g_star,
        "k3/loss": k3_loss, "k3/reward": g_star - k3_loss, "k3/reward+loss": g_star,
        "k2/loss": k2_loss, "k2/reward": k2_total - k2_loss, "k2/reward+loss": k2_total,
    }


def _forward_ce(p, q):
    """Cross-entropy H(Bern(q), Bern(p)); its gradient in the logit of p is p - q (K3 in the loss)."""
    return -(q * p.log() + (1 - q) * (1 - p).log())


# ---------------------------------------------------------------- estimators via the production loss

@dataclass(frozen=True)
class ToyRun:
    """One row of the study: a KL configuration and whether samples come from A_old."""

    name: str
    kl: KLConfig
    off_policy: bool = False


def default_runs() -> list:
    """K1/K2/K3 x reward/loss/reward+loss on-policy, then off-policy under each correction."""
    runs = []
    grid = [(est, pl) for est in ("k1", "k2", "k3") for pl in ("reward", "loss", "reward+loss")]
    for est, pl in grid:
        runs.append(ToyRun(f"{est}/{pl}", KLConfig(est, pl, coef=1.0)))
    runs.append(ToyRun("k1/reward rtg", KLConfig("k1", "reward", coef=1.0, reward_to_go=True)))
    for corr in ("none", "token-is", "seq-is"):
        for est, pl in grid:
            kl = KLConfig(est, pl, coef=1.0, off_policy_correction=corr)
            runs.append(ToyRun(f"{est}/{pl} off:{corr}", kl, off_policy=True))
    seq_is = KLConfig("k1", "reward", coef=1.0, off_policy_correction="seq-is")
    runs.append(ToyRun("k1/reward off:seq-is rtg", replace(seq_is, reward_to_go=True), True))
    runs.append(ToyRun("k1/reward off:seq-is trunc2", replace(seq_is, is_truncation=2.0), True))
    for est in ("k1", "k3"):
        kl = KLConfig(est, "loss", coef=1.0, off_policy_correction="token-is", is_weight_grad=True)
        runs.append(ToyRun(f"{est}/loss off:token-is grad", kl, True))
    return runs


def estimator_gradients(policy: BinaryARPolicy, ref_policy: BinaryARPolicy, y: torch.Tensor,
                        kl_cfg: KLConfig, old_policy: BinaryARPolicy | None = None,
                        seq_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient [K, 2] (d/da, d/db) of the configuration's loss per parameter copy of `policy`.

    y [K, N, T] (or [1, N, T]): the sequences; old_policy: the sampling policy when off-policy
    (None: on-policy, old_logprobs = logprobs detached). Without seq_weights the loss is the mean
    over the N sequences (a Monte-Carlo estimate); with seq_weights [N] it is sum_i w_i loss_i
    (an exact expectation when y enumerates all sequences and w their probabilities).
    """
    logprobs = policy(y)
    num_copies, num_seqs, seq_len = logprobs.shape
    with torch.no_grad():
        ref = ref_policy(y).expand_as(logprobs)
        old = (old_policy(y) if old_policy is not None else logprobs).expand_as(logprobs)

    def flat(x):
        return x.reshape(num_copies * num_seqs, seq_len)

    mask = torch.ones(num_copies * num_seqs, seq_len, dtype=DTYPE)
    cfg = LossConfig(clip_low=1.0, clip_high=math.inf, aggregation="seq-mean-token-sum",
                     kl=kl_cfg, advantage_estimator="reinforce")
    rewards = torch.zeros(num_copies * num_seqs, dtype=DTYPE)
    advantages = build_advantages(rewards, flat(logprobs).detach(), flat(ref), mask, cfg, group_size=1)
    per_token, _ = policy_loss_per_token(flat(logprobs), flat(old), advantages, mask, cfg,
                                         ref_logprobs=flat(ref))
    normalizer = num_seqs
    if seq_weights is not None:
        per_token = per_token * seq_weights.repeat(num_copies)[:, None]
        normalizer = 1
    # Copies share nothing, so the gradient of the summed loss w.r.t. copy k is copy k's gradient.
    loss = aggregate_loss(per_token, mask, cfg.aggregation, num_global_seqs=normalizer)
    grad_a, grad_b = torch.autograd.grad(loss, [policy.a, policy.b])
    return torch.stack([grad_a, grad_b], dim=-1)


def enumerated_kl_gradient(theta, ref, seq_len) -> torch.Tensor:
    """g* [2] by exact enumeration: grad sum_y A(y) log(A(y) / B(y))."""
    policy, ref_policy = BinaryARPolicy(*theta), BinaryARPolicy(*ref)
    y = all_sequences(seq_len)
    seq_logprobs = policy(y).sum(-1)
    kl = (seq_logprobs.exp() * (seq_logprobs - ref_policy(y).sum(-1).detach())).sum()
    return torch.stack(torch.autograd.grad(kl, [policy.a, policy.b]), dim=-1).squeeze(0)


def exact_expected_gradient(theta, ref, seq_len, kl_cfg: KLConfig, old=None) -> torch.Tensor:
    """E[gradient estimate] [2] by summing over all 2^T sequences (weights A_theta or A_old)."""
    policy, ref_policy = BinaryARPolicy(*theta), BinaryARPolicy(*ref)
    old_policy = BinaryARPolicy(*old) if old is not None else None
    y = all_sequences(seq_len)
    with torch.no_grad():
        sampler = old_policy if old_policy is not None else policy
        weights = sampler(y).sum(-1).exp().squeeze(0)
    return estimator_gradients(policy, ref_policy, y, kl_cfg, old_policy, weights).squeeze(0)


# ---------------------------------------------------------------- the study

@dataclass
class ToySetup:
    """Parameters (a, b) of A_theta, B (reference) and A_old (off-policy sampler); MC sizes."""

    seq_len: int = 8
    theta: tuple = (0.5, -1.0)
    ref: tuple = (-0.5, 1.0)
    old: tuple = (0.9, -0.6)
    num_trials: int = 200
    num_samples: int = 1000
    seed: int = 0
    runs: list = field(default_factory=default_runs)


def run_study(setup: ToySetup) -> dict:
    """Exact and Monte-Carlo squared bias and variance of every run in setup.runs."""
    start, start_cpu = time.perf_counter(), time.process_time()
    g_star = true_gradient(setup.theta, setup.ref, setup.seq_len)
    g_enum = enumerated_kl_gradient(setup.theta, setup.ref, setup.seq_len)
    closed = closed_form_gradients(setup.theta, setup.ref, setup.seq_len)

    generator = torch.Generator().manual_seed(setup.seed)
    k, n, t = setup.num_trials, setup.num_samples, setup.seq_len
    samples = {False: BinaryARPolicy(*setup.theta, k).sample(n, t, generator),
               True: BinaryARPolicy(*setup.old, k).sample(n, t, generator)}
    ref_policy, old_policy = BinaryARPolicy(*setup.ref), BinaryARPolicy(*setup.old)
    # Trials run in chunks: the same numbers, but [chunk * N, T] tensors stay cache-sized (~1.5x faster).
    chunks = [(lo, min(lo + TRIAL_CHUNK, k)) for lo in range(0, k, TRIAL_CHUNK)]
    mc_policies = {size: BinaryARPolicy(*setup.theta, size) for size in {hi - lo for lo, hi in chunks}}

    rows = []
    for run in setup.runs:
        old = setup.old if run.off_policy else None
        exact = exact_expected_gradient(setup.theta, setup.ref, t, run.kl, old)
        grads = torch.cat([
            estimator_gradients(mc_policies[hi - lo], ref_policy, samples[run.off_policy][lo:hi],
                                run.kl, old_policy if run.off_policy else None)
            for lo, hi in chunks])
        mc_mean = grads.mean(0)
        exact_sq_bias = (exact - g_star).square().sum().item()
        row = {
            "config": run.name, "estimator": run.kl.estimator, "placement": run.kl.placement,
            "sampling": "off-policy" if run.off_policy else "on-policy",
            "correction": run.kl.off_policy_correction,
            "exact_grad": exact.tolist(), "exact_sq_bias": exact_sq_bias,
            "mc_mean_grad": mc_mean.tolist(),
            "mc_sq_bias": (mc_mean - g_star).square().sum().item(),
            "mc_variance": grads.var(0).sum().item(),
            "biased": exact_sq_bias > UNBIASED_TOL,
        }
        key = f"{run.kl.estimator}/{run.kl.placement}"
        if not run.off_policy and key in closed:
            row["closed_form_abs_err"] = (exact - closed[key]).abs().max().item()
        rows.append(row)
    return {
        "setup": {"seq_len": t, "theta": list(setup.theta), "ref": list(setup.ref),
                  "old": list(setup.old), "num_trials": k, "num_samples": n, "seed": setup.seed,
                  "beta": 1.0, "advantage": "reinforce (no baseline)",
                  "aggregation": "seq-mean-token-sum", "dtype": "float64"},
        "true_gradient": g_star.tolist(),
        "true_gradient_enum_abs_err": (g_enum - g_star).abs().max().item(),
        "rows": rows,
        "runtime_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - start_cpu,
    }


def markdown_table(result: dict) -> str:
    """Table-1-like summary of run_study's result."""
    setup = result["setup"]
    lines = [
        f"Toy study (T={setup['seq_len']}, theta={setup['theta']}, ref={setup['ref']}, "
        f"old={setup['old']}; MC: {setup['num_trials']} trials x {setup['num_samples']} samples). "
        f"True gradient of KL(A||B): {[round(v, 6) for v in result['true_gradient']]}. "
        f"MC bias^2 includes the MC noise variance/{setup['num_trials']}.",
        "",
        "| config | sampling | exact bias^2 | MC bias^2 | MC variance | biased |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['config']} | {row['sampling']} | {row['exact_sq_bias']:.3e} | "
                     f"{row['mc_sq_bias']:.3e} | {row['mc_variance']:.3e} | "
                     f"{'yes' if row['biased'] else 'no'} |")
    lines.append("")
    lines.append(f"Runtime: {result['runtime_s']:.1f} s wall, {result['cpu_s']:.1f} s CPU "
                 f"(torch threads: {torch.get_num_threads()})")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path):
    """Bars of exact squared bias and MC variance per configuration (paper Fig. 1 style)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-12
    panels = [("on-policy", "on-policy (samples from A_theta)"),
              ("off-policy", "off-policy (samples from A_old)")]
    fig, axes = plt.subplots(2, 1, figsize=(14, 9))
    for ax, (sampling, title) in zip(axes, panels):
        rows = [r for r in result["rows"] if r["sampling"] == sampling]
        x = torch.arange(len(rows), dtype=torch.float64).numpy()
        bias = [max(r["exact_sq_bias"], floor) for r in rows]
        var = [max(r["mc_variance"], floor) for r in rows]
        ax.bar(x - 0.2, bias, width=0.4, label="squared bias (exact)", color="tab:red")
        ax.bar(x + 0.2, var, width=0.4, label="variance (MC, N per trial)", color="tab:blue")
        ax.set_yscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels([r["config"].replace(" off:", "\n") for r in rows], rotation=60,
                           ha="right", fontsize=7)
        ax.set_title(f"{title}; bars at {floor:g} are unbiased (exact bias^2 ~ 0)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    """`python tools/toy_kl_study.py` / `megatron-rl toy`: write table.md, results.json, figure.png."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/toy", help="output directory")
    parser.add_argument("--seq-len", type=int, default=ToySetup.seq_len)
    parser.add_argument("--num-trials", type=int, default=ToySetup.num_trials)
    parser.add_argument("--num-samples", type=int, default=ToySetup.num_samples)
    parser.add_argument("--seed", type=int, default=ToySetup.seed)
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG figure")
    args = parser.parse_args(argv)
    if args.seq_len < 1 or args.seq_len > 16:
        raise ValueError(f"--seq-len must be in [1, 16] (2^T sequences are enumerated), got {args.seq_len}")

    setup = ToySetup(seq_len=args.seq_len, num_trials=args.num_trials,
                     num_samples=args.num_samples, seed=args.seed)
    result = run_study(setup)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(result)
    (out / "table.md").write_text(table)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_plot:
        plot(result, out / "figure.png")
    print(table)
    print(f"wrote {out}/table.md, results.json" + ("" if args.no_plot else ", figure.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
