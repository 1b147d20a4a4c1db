"""Exact gradient study of KL estimator configurations on a toy model (paper Sec. 3.3, Fig. 1).

Model ("count", the default: the paper's eq. 17-18). A_theta is a binary autoregressive policy
over y in {0, 1}^T with
    p_t = A_theta(y_t = 1 | y_<t) = sigmoid(a + b c_{t-1}),   c_{t-1} = sum_{k<t} y_k,   c_0 = 0,
i.e. token t depends on the number of ones so far; theta = (a, b). The reference B is the same
model with (a~, b~), and off-policy samples come from A_old with (a_old, b_old). Eq. 17-18
condition token t on the count c_{t-1} = sum_{k<t} y_k; the functional form of that dependence,
a sigmoid of an affine function of the count, is this module's choice and not taken from the
paper, as are the default parameters (DEFAULT_PARAMS: theta (0.5, -0.25), ref (-0.5, 0.25),
old (0.9, -0.15), T = 8; KL 0.51 nats). Option `--model sign`: a second model with
c_{t-1} = 2 y_{t-1} - 1 (c_0 = 0), token t conditioned on the previous token's sign, with
defaults (0.5, -1), (-0.5, 1), (0.9, -0.6).
Parameters are float64 and the module gives per-token log-probs [K, N, T] for K parameter copies
(K = 1 for one batch; K = num_trials for vectorized Monte Carlo; K = 2^T for per-sequence
gradients by enumeration: copies share nothing, so one backward pass gives every copy's gradient).

Target. The true gradient of the sequence-level reverse KL,
    g* = grad_theta KL(A_theta || B) = E_A[(sum_t K1_t) grad log A_theta(y)],
computed three independent ways: exact enumeration of all 2^T sequences; autograd through the
dynamic programme below; the explicit closed form (C3) below.

Closed forms (App. C's eq. 20-22, derived here for this parametrisation; `closed_form_kl`,
`closed_form_kl_gradient`). Both models are Markov chains on a state s = c_{t-1} with feature
phi(s) = (1, c): count: c in {0, ..., t-1}, s -> s + y_t; sign: c in {0, -1, +1}, s -> 2 y_t - 1.
Write p_s = sigmoid(z_s), z_s = a + b c, q_s = sigmoid(a~ + b~ c), and
KL_s = KL(Bern(p_s) || Bern(q_s)) = p_s log(p_s/q_s) + (1 - p_s) log((1 - p_s)/(1 - q_s)).
(C1) Law of the state, m_t(s) = A_theta(c_{t-1} = s): m_1 = delta_0 and, for the count model,
         m_{t+1}(c) = m_t(c) (1 - p_c) + m_t(c - 1) p_{c-1}
     (a Poisson-binomial-like recursion whose success probability depends on the count).
(C2) KL(A_theta || B) = sum_{t=1}^T sum_s m_t(s) KL_s = V_1(0), with the KL-to-go
         V_{T+1} = 0,   V_t(s) = KL_s + (1 - p_s) V_{t+1}(s -> 0) + p_s V_{t+1}(s -> 1).
(C3) g* = sum_t sum_s m_t(s) p_s (1 - p_s) [ (z_s - logit q_s) + V_{t+1}(s -> 1) - V_{t+1}(s -> 0) ] phi(s),
     the derivative of (C2): d KL_s / d z_s = p_s (1 - p_s)(z_s - logit q_s) is the path-wise part,
     d p_s / d z_s = p_s (1 - p_s) times the jump in the KL-to-go is the score-function part.
For the count model the states at step t are c = 0..t-1: O(T^2) work instead of O(2^T T).

Estimators. Each K1/K2/K3 configuration is run through the production code path: megatron_rl.loss
`build_advantages` -> `policy_loss_per_token` -> `aggregate_loss` (kl.py inside), with task
reward 0 and beta = 1, so the loss gradient is the KL-regularizer gradient alone. Choices:
- advantage estimator "reinforce", so that each sequence's gradient depends on that sequence
  alone (what enumeration needs). A baseline b changes no expectation (with clipping off the
  surrogate's gradient is ratio_t A s_t and E_old[ratio_t s_t | y_<t] = 0, on- and off-policy),
  only the variance: the "mean baseline" column subtracts b = E[KL penalty] (per position for
  per-token returns), the large-group limit of RLOO.
- aggregation "seq-mean-token-sum", so a loss of N sequences is the mean of the sequence-level
  objective (the paper's per-token normalization only divides by the constant T here).
- clipping disabled (clip_low = 1, clip_high = inf): only the KL estimator's bias is measured.
The `exact` estimator (`ExactKL`, `exact_kl_loss_per_token`) is the toy's own: its per-position
KL_t = KL(A_theta(.|y_<t) || B(.|y_<t)) needs both full next-token distributions, which the
trainer's estimators (sampled-token log-probs only) do not see. Its reward side goes through the
same `compute_advantages` -> `policy_loss_per_token` (KL placement "none"), its loss side and
importance weights are added here with kl.py's `importance_weights`, and it is aggregated by
`aggregate_loss`. Which placement makes it unbiased is derived in megatron_rl/kl.py's docstring:
reward+loss (path-wise + score-function terms), with token t's return counting only the later
positions (`kl_return="later"`, the estimator derived there; the lowest-variance of the three
returns in 5 of the 6 settings of the variance table); "full" and "to-go" are unbiased too.

Exact columns. g(y) is the configuration's gradient on the single sequence y (N = 1), computed for
all 2^T sequences at once (one parameter copy per sequence). With w(y) = A_theta(y) on-policy or
A_old(y) off-policy: E[grad] = sum_y w(y) g(y); bias^2 = |E[grad] - g*|^2; per-sample variance =
sum_y w(y) |g(y) - E[grad]|^2 (trace of the covariance; an N-sample batch has variance / N).
On-policy the expected gradients also equal the closed forms of `closed_form_gradients`:
    E[grad, K1 in loss]   = E[sum_t s_t] = 0
    E[grad, K1 in reward] = E[(sum_t K1_t) S] = g*
    E[grad, K3 in loss]   = -E[sum_t r_t s_t] = sum_t sum_s m_t(s) (p_s - q_s) phi(s)
        since E_{y~p}[r s] = sum_y q(y) grad log p(y) = (q - p) phi(s): the gradient of the
        token-level forward KL(B || A_theta) at A_theta's prefixes, not of the reverse KL.
    E[grad, K3 in reward] = grad E[sum_t K3_t] - E[grad, K3 in loss] = g* - E[grad, K3 in loss]
        since E_A[K3_t | y_<t] = KL_t, so E_A[sum_t K3_t] = KL(A_theta || B).
    E[grad, K2 in loss]   = E[sum_t K1_t s_t] = sum_t sum_s m_t(s) grad KL_s (marginals held):
        the path-wise term of g* only; so is E[grad, exact in loss] (the same expression).
    E[grad, exact in reward] = g* - E[grad, exact in loss]: the score-function term only.
    E[grad, K in reward+loss] = grad E[sum_t K_t]: g* for K1, K3 and exact; for K2 the gradient
        of E[sum_t K2_t], which is not the KL.
Off-policy (samples from A_old; expectations by enumeration only): with correction "none" or
"token-is" every configuration is biased. For the reward placement the two coincide: the PPO
per-token ratio already is the token-level correction of anything inside the advantage. "seq-is"
reproduces each on-policy expectation exactly (so K1 reward, K1 / K3 / exact reward+loss are
unbiased), usually at a higher variance; truncating its weights brings the bias back.
MC columns (a check of the sampler and of the exact columns): num_trials independent batches of
num_samples sequences; MC bias^2 = |mean of the trials' gradients - g*|^2 (includes the noise
variance / (num_trials num_samples)); MC variance per sample = num_samples x the variance across
trials of a trial's mean gradient, an estimate of the exact per-sample variance.
Three distributions (`--rollout a b`, `three_distribution_study`; exact columns only). Samples come
from mu = A_rollout (the engine; its log-probs are the trainer's rollout_logprobs), the PPO ratio
divides by pi_old = A_old (the trainer's recompute), and the KL's token-is / seq-is weights divide
by pi_old ("behaviour") or by mu ("rollout"), through the production loss. With w(y) = mu(y) in the
exact columns: each configuration's bias^2 and per-sample variance with correction "none" and with
token-is and seq-is against either; seq-is with weights truncated at c (`--is-truncation`), with
the shift |E_c - E|^2 that the truncation causes; and the KL inside the advantage under the
trainer's --rollout-correction (correction.py's weights pi_old/mu on the surrogate, float32 as it
computes them). Which weights are unbiased, and the bias of the others: megatron_rl/kl.py's
docstring, "Three distributions". Without --rollout this study is not run.
Mixed versions (`--versions A B`, `--switch`, `versions_study`; exact columns only). A partial
rollout that outlived a weight update: each sample's tokens before the switch come from the older
version A, after it from the newer B (`switch_branches`: a fixed point S, S uniform and independent
of the tokens, or after the K-th token 1), so the sampler is q(y) = prod_t mu_{v(t)}(y_t | y_<t)
(averaged over the switch). Every (sequence, switch outcome) is one sample of weight q; its
rollout_logprobs hold each token's own version's log-prob ("own") or the newer version's at every
token ("last", one mu for the whole sequence); pi_old = A_old as above. Columns: the KL with no
correction, token-is against each token's own version, seq-is against pi_old, against each
token's own version, and against B alone; the KL inside the advantage under --rollout-correction
on the own record; K1 in the reward at each fixed S. Derivation and table: docs/results.md,
"Mixed versions". Without --versions this study is not run.
Trajectories (`--env-tokens LAYOUT`, `trajectory_study`; exact columns only). T binary tokens
interleave the policy's with environment tokens (a tool's output) drawn from a fixed kernel
E(x_t = 1 | h_t) = sigmoid(e0 + e1 c_{t-1}) (`--env`), c_{t-1} from every earlier token, the
environment's included; which positions are the environment's is a function of the prefix
(`policy_token_mask`: "call", one after each policy token 1; "alternate"). The trajectory law is
P_theta(tau) = prod_{policy t} A_theta(x_t | h_t) prod_{env t} E(x_t | h_t), P_ref the same with B,
and the target g* = grad KL(P_theta || P_ref): by autograd of the enumerated KL (environment factors
kept) and by the score-function sum over the policy's tokens without autograd. Every configuration
runs through the production loss with loss_mask = the policy's tokens ("masked", what the trainer
passes), every token ("charged": the environment's tokens scored as if the policy had sampled
them), or the policy's tokens with the environment tokens' ratios in the seq-is weights
("env-in-weights"); on-policy and off-policy (A_old at the policy's tokens, the same kernel at the
environment's) under each correction. Derivation and table: docs/results.md, "Trajectories with
environment tokens". With it, per-turn rewards (`turn_reward_study`): each turn's reward from
the environment's answer to its call and the final answer (`reward_events`), the policy
gradient of E[sum_j R_j] - KL under each TURN_CREDITS rule against its autograd
(docs/results.md, "Per-turn rewards"). Without --env-tokens this study is not run.
Policy losses (`--policy-loss NAME|all`, `policy_loss_study`; exact columns only). Every
(--policy-loss x K1/K2/K3 x placement), on-policy and off-policy under each correction, through the
production loss with that loss, with clipping off (clip_low 1, clip_high inf; dual-clip keeps its
bound c, sapo's gate has no off) and with each loss's own (POLICY_LOSS_CLIPS). `--stop-after-ones
K` gives the study variable lengths: a sequence ends at the token 1 that brings its count of ones
to K (the stop token), the positions after it are masked out of the loss (`stop_mask`; one
representative per stopped sequence is enumerated). `--loss-aggregation seq-mean-token-mean`
weighs a sequence's tokens 1/n and takes the per-token-averaged KL E[log(A_theta/B)(y)/n] as the
target. Derivations (on-policy every loss is the same; GSPO's 1/n and the aggregation's; what
each loss does off-policy) and tables: docs/results.md, "Policy losses and KL placements".
Without --policy-loss this study is not run.
"""
import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from megatron_rl.advantages import compute_advantages
from megatron_rl.correction import RolloutCorrectionConfig, rollout_correction_weights
from megatron_rl.kl import (IS_PROPOSALS, OFF_POLICY_CORRECTIONS, KLConfig, Placement,
                            get_estimator, importance_weights)
from megatron_rl.loss import (LossConfig, aggregate_loss, build_advantages, compute_rewards_with_kl,
                              policy_loss_per_token)
from megatron_rl.policy_losses import POLICY_LOSSES

DTYPE = torch.float64
UNBIASED_TOL = 1e-20
TRIAL_CHUNK = 20
MODELS = ("count", "sign")
MAX_SEQ_LEN = 16
EXACT_RETURNS = ("full", "to-go", "later")
# Configurations compared in the variance summary: the unbiased on-policy ones and K3 in the loss.
VARIANCE_SUMMARY = ("k1/reward", "k1/reward rtg", "k1/reward+loss", "k3/reward+loss", "k3/loss",
                    "exact/reward+loss", "exact/reward+loss to-go", "exact/reward+loss later")


def prefix_features(y: torch.Tensor, model: str) -> torch.Tensor:
    """c_{t-1} for every position, [..., T] from y [..., T] in {0, 1}.

    count: c_{t-1} = sum_{k<t} y_k (0 at t = 1). sign: c_{t-1} = 2 y_{t-1} - 1 (0 at t = 1).
    """
    if model == "count":
        return torch.cumsum(y, dim=-1) - y
    if model == "sign":
        return torch.cat([torch.zeros_like(y[..., :1]), 2 * y[..., :-1] - 1], dim=-1)
    raise ValueError(f"unknown toy model {model!r}; valid: {list(MODELS)}")


class BinaryARPolicy(nn.Module):
    """p_t = sigmoid(a + b c_{t-1}) with c_{t-1} from `prefix_features`; K independent copies."""

    def __init__(self, a: float, b: float, num_copies: int = 1, model: str = "count"):
        super().__init__()
        if model not in MODELS:
            raise ValueError(f"unknown toy model {model!r}; valid: {list(MODELS)}")
        self.model = model
        self.a = nn.Parameter(torch.full((num_copies,), float(a), dtype=DTYPE))
        self.b = nn.Parameter(torch.full((num_copies,), float(b), dtype=DTYPE))

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """y [K, N, T] in {0, 1} -> logits z_t of P(y_t = 1 | y_<t), [K, N, T]."""
        return self.a[:, None, None] + self.b[:, None, None] * prefix_features(y, self.model)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs log p(y_t | y_<t), [K, N, T]; y is broadcast over copies if [1, N, T]."""
        # log P(y) = log sigmoid(+z) for y = 1 and log sigmoid(-z) for y = 0.
        return nn.functional.logsigmoid((2 * y - 1) * self.logits(y))

    @torch.no_grad()
    def sample(self, num_samples: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """[K, num_samples, seq_len] sequences, one batch per parameter copy."""
        num_copies = self.a.shape[0]
        y = torch.zeros(num_copies, num_samples, seq_len, dtype=DTYPE)
        c = torch.zeros(num_copies, num_samples, dtype=DTYPE)
        for t in range(seq_len):
            p = torch.sigmoid(self.a[:, None] + self.b[:, None] * c)
            u = torch.rand(num_copies, num_samples, dtype=DTYPE, generator=generator)
            y[..., t] = (u < p).to(DTYPE)
            c = c + y[..., t] if self.model == "count" else 2 * y[..., t] - 1
        return y


def all_sequences(seq_len: int) -> torch.Tensor:
    """All 2^T binary sequences, [1, 2^T, T] float64."""
    idx = torch.arange(2 ** seq_len)
    bits = (idx[:, None] >> torch.arange(seq_len - 1, -1, -1)) & 1
    return bits.to(DTYPE).unsqueeze(0)


def bernoulli_kl(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """KL(Bern(sigmoid(logits_p)) || Bern(sigmoid(logits_q))), elementwise, from logits (stable).

    = p (log p - log q) + (1 - p) (log(1 - p) - log(1 - q)), log p = logsigmoid(z),
    log(1 - p) = logsigmoid(-z). Its derivative in logits_p is p (1 - p) (logits_p - logits_q).
    """
    p = torch.sigmoid(logits_p)
    ls = nn.functional.logsigmoid
    return p * (ls(logits_p) - ls(logits_q)) + (1 - p) * (ls(-logits_p) - ls(-logits_q))


# ---------------------------------------------------------------- closed forms (Markov chain on c)

def _chain(model: str, seq_len: int):
    """(features c [S], next state after y=0 [S], after y=1 [S], initial state index) of the model.

    count: states c = 0..T (c = T is never a prefix state of t <= T; it keeps the chain closed).
    sign: states (start, previous 0, previous 1) with c = (0, -1, +1).
    """
    if model == "count":
        states = torch.arange(seq_len + 1)
        return states.to(DTYPE), states, (states + 1).clamp(max=seq_len), 0
    if model == "sign":
        return (torch.tensor([0.0, -1.0, 1.0], dtype=DTYPE), torch.tensor([1, 1, 1]),
                torch.tensor([2, 2, 2]), 0)
    raise ValueError(f"unknown toy model {model!r}; valid: {list(MODELS)}")


def _state_marginals(a, b, seq_len: int, model: str):
    """(C1): m_t(s) = A_theta(c_{t-1} = s) for t = 1..T ([T, S]) and p_s ([S]); a, b tensors."""
    feats, nxt0, nxt1, init = _chain(model, seq_len)
    p = torch.sigmoid(a + b * feats)
    m = torch.zeros(len(feats), dtype=DTYPE)
    m[init] = 1.0
    rows = []
    for _ in range(seq_len):
        rows.append(m)
        m = torch.zeros_like(m).index_add(0, nxt0, m * (1 - p)).index_add(0, nxt1, m * p)
    return torch.stack(rows), p


def _as_tensor(x, requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(float(x), dtype=DTYPE, requires_grad=requires_grad)


def closed_form_kl(theta, ref, seq_len: int, model: str = "count") -> float:
    """(C2): KL(A_theta || B) = sum_t sum_s m_t(s) KL(Bern(p_s) || Bern(q_s)), O(T S)."""
    feats = _chain(model, seq_len)[0]
    m, _ = _state_marginals(_as_tensor(theta[0]), _as_tensor(theta[1]), seq_len, model)
    kl = bernoulli_kl(theta[0] + theta[1] * feats, ref[0] + ref[1] * feats)
    return (m * kl).sum().item()


def closed_form_kl_gradient(theta, ref, seq_len: int, model: str = "count") -> torch.Tensor:
    """(C3): g* [2] from the forward law m_t and the backward KL-to-go V_t; no autograd.

    g* = sum_t sum_s m_t(s) p_s (1 - p_s) [(z_s - logit q_s) + V_{t+1}(s->1) - V_{t+1}(s->0)] (1, c_s).
    """
    feats, nxt0, nxt1, _ = _chain(model, seq_len)
    z, zq = theta[0] + theta[1] * feats, ref[0] + ref[1] * feats
    m, p = _state_marginals(_as_tensor(theta[0]), _as_tensor(theta[1]), seq_len, model)
    kl = bernoulli_kl(z, zq)
    value = torch.zeros_like(feats)  # V_{T+1}
    grad = torch.zeros(2, dtype=DTYPE)
    for t in range(seq_len - 1, -1, -1):  # row t of m is m_{t+1} (1-based); value is V_{t+2}
        coeff = m[t] * p * (1 - p) * ((z - zq) + value[nxt1] - value[nxt0])
        grad += torch.stack([coeff.sum(), (coeff * feats).sum()])
        value = kl + (1 - p) * value[nxt0] + p * value[nxt1]
    return grad


def _token_expectation_grad(theta, ref, seq_len, model, token_fn, hold_marginals):
    """grad_(a,b) of sum_t sum_s m_t(s) token_fn(z_s, zq_s); m_t held fixed if hold_marginals."""
    a, b = _as_tensor(theta[0], True), _as_tensor(theta[1], True)
    feats = _chain(model, seq_len)[0]
    m, _ = _state_marginals(a, b, seq_len, model)
    if hold_marginals:
        m = m.detach()
    value = (m * token_fn(a + b * feats, ref[0] + ref[1] * feats)).sum()
    return torch.stack(torch.autograd.grad(value, [a, b]))


def _expected_k2(z, zq):
    """E_{y ~ Bern(p)}[0.5 (log q(y) - log p(y))^2] from logits."""
    ls = nn.functional.logsigmoid
    p = torch.sigmoid(z)
    return 0.5 * (p * (ls(zq) - ls(z)).square() + (1 - p) * (ls(-zq) - ls(-z)).square())


def _forward_ce(z, zq):
    """Cross-entropy H(Bern(q), Bern(p)); its gradient in the logit of p is p - q (K3 in the loss)."""
    ls = nn.functional.logsigmoid
    q = torch.sigmoid(zq)
    return -(q * ls(z) + (1 - q) * ls(-z))


def true_gradient(theta, ref, seq_len, model: str = "count") -> torch.Tensor:
    """g* = grad KL(A_theta || B) [2] by autograd through the recursion (C1)-(C2)."""
    return _token_expectation_grad(theta, ref, seq_len, model, bernoulli_kl, hold_marginals=False)


def closed_form_gradients(theta, ref, seq_len, model: str = "count") -> dict:
    """Expected gradients [2] of the on-policy configurations (beta = 1), keyed "estimator/placement"."""
    g_star = true_gradient(theta, ref, seq_len, model)
    k3_loss = _token_expectation_grad(theta, ref, seq_len, model, _forward_ce, hold_marginals=True)
    pathwise = _token_expectation_grad(theta, ref, seq_len, model, bernoulli_kl, hold_marginals=True)
    k2_total = _token_expectation_grad(theta, ref, seq_len, model, _expected_k2, hold_marginals=False)
    return {
        "k1/loss": torch.zeros(2, dtype=DTYPE), "k1/reward": g_star, "k1/reward+loss": g_star,
        "k3/loss": k3_loss, "k3/reward": g_star - k3_loss, "k3/reward+loss": g_star,
        "k2/loss": pathwise, "k2/reward": k2_total - pathwise, "k2/reward+loss": k2_total,
        "exact/loss": pathwise, "exact/reward": g_star - pathwise, "exact/reward+loss": g_star,
    }


# ---------------------------------------------------------------- the exact estimator (toy only)

@dataclass(frozen=True)
class ExactKL(Placement):
    """The `exact` estimator's configuration: KL_t = KL(A_theta(.|y_<t) || B(.|y_<t)), beta = 1.

    placement: "reward" (stop-gradient, in the return), "loss" (differentiated), "reward+loss".
    kl_return: what token t's return holds on the reward side: "full" (sum_s KL_s, as the
        trainer's reward placement), "to-go" (sum_{s>=t} KL_s, as --kl-reward-to-go), "later"
        (sum_{s>t} KL_s: the score-function term of kl.py's derivation; KL_t itself does not
        depend on y_t, so counting it adds zero-mean noise).
    off_policy_correction: "none", "token-is", "seq-is", with the meaning of kl.KLConfig (weights
        from kl.importance_weights; the reward side under "seq-is" is an importance-weighted
        surrogate as in kl.kl_reward_is_surrogate, per-decision weights for "to-go" / "later").
    is_proposal: what those weights divide by, as kl.KLConfig's: "behaviour" (pi_old) or
        "rollout" (mu, the distribution that sampled; needs rollout_logprobs).
    """

    estimator: ClassVar[str] = "exact"
    placement: str = "reward+loss"
    kl_return: str = "full"
    off_policy_correction: str = "none"
    is_proposal: str = "behaviour"

    def __post_init__(self):
        if self.placement not in ("reward", "loss", "reward+loss"):
            raise ValueError(f"exact: unknown placement {self.placement!r}")
        if self.kl_return not in EXACT_RETURNS:
            raise ValueError(f"exact: unknown kl_return {self.kl_return!r}; valid: {list(EXACT_RETURNS)}")
        if self.off_policy_correction not in OFF_POLICY_CORRECTIONS:
            raise ValueError(f"exact: unknown off_policy_correction {self.off_policy_correction!r}")
        if self.is_proposal not in IS_PROPOSALS:
            raise ValueError(f"exact: unknown is_proposal {self.is_proposal!r}; valid: {list(IS_PROPOSALS)}")


def _kl_returns(kl: torch.Tensor, kind: str) -> torch.Tensor:
    """[B, T] per-position KL -> returns: [B] sum_s ("full"), [B, T] sum_{s>=t} ("to-go") or sum_{s>t}."""
    if kind == "full":
        return kl.sum(-1)
    to_go = kl.flip(-1).cumsum(-1).flip(-1)
    return to_go if kind == "to-go" else to_go - kl


def exact_kl_loss_per_token(logprobs, old_logprobs, kl, loss_mask, cfg: ExactKL,
                            return_baseline: torch.Tensor | None = None,
                            rollout_logprobs: torch.Tensor | None = None,
                            is_weights: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] per-token loss of the `exact` estimator with beta = 1 (task reward 0), differentiable.

    logprobs [B, T]: log A_theta(y_t | y_<t) at the sampled tokens (with grad); old_logprobs [B, T]:
    the sampler's (= logprobs.detach() on-policy); kl [B, T]: KL_t(y_<t) (with grad through A_theta).
    - reward side, correction "none" / "token-is": return -R_t with R_t = `_kl_returns(kl.detach())`
      through compute_advantages("reinforce") and policy_loss_per_token (KL placement "none");
      gradient on-policy: R_t s_t. Under "seq-is": surrogate sg(w) sg(R) logprobs_t with the
      sequence weight w (full) or per-decision weights sum_{s>=t or s>t} w_{<=s} KL_s.
    - loss side: weight_t * KL_t, weight 1 ("none"), omega_t ("token-is") or w_{<=t} ("seq-is"),
      detached; gradient weight_t grad KL_t (path-wise).
    return_baseline: a constant b subtracted from R_t in the advantage (not under "seq-is").
    rollout_logprobs [B, T]: the sampler mu's log-probs, which the importance weights divide by
    under cfg.is_proposal "rollout" (else by old_logprobs, the PPO ratio's denominator);
    is_weights [B, T]: the rollout correction's weights on the policy-gradient term (correction.py).
    """
    mask = loss_mask.to(logprobs.dtype)
    kl = kl * mask
    correction = cfg.off_policy_correction
    proposal = old_logprobs
    if cfg.is_proposal == "rollout" and correction != "none":
        if rollout_logprobs is None:
            raise ValueError("exact: is_proposal 'rollout' needs rollout_logprobs")
        proposal = rollout_logprobs
    if cfg.in_reward and correction != "seq-is":
        penalty = _kl_returns(kl.detach(), cfg.kl_return)
        if return_baseline is not None:
            penalty = penalty - return_baseline
        returns = -penalty
        advantages = compute_advantages("reinforce", returns, 1, mask if returns.dim() == 2 else None)
    else:
        advantages = torch.zeros(logprobs.shape[0], dtype=logprobs.dtype)
    loss_cfg = LossConfig(clip_low=1.0, clip_high=math.inf, aggregation="seq-mean-token-sum",
                          kl=KLConfig("k1", "none", coef=1.0), advantage_estimator="reinforce")
    per_token, _ = policy_loss_per_token(logprobs, old_logprobs, advantages, mask, loss_cfg,
                                         is_weights=is_weights)
    if cfg.in_reward and correction == "seq-is":
        with torch.no_grad():
            prefix_w = importance_weights(logprobs, proposal, mask, "prefix")
            if cfg.kl_return == "full":
                # The sequence weight is the prefix weight at the last token of the mask, which
                # need not be the last position (padding, environment tokens).
                last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
                returns = (prefix_w * last).sum(-1, keepdim=True) * kl.sum(-1, keepdim=True)
            else:
                returns = _kl_returns(prefix_w * kl.detach(), cfg.kl_return)
        per_token = per_token + returns * logprobs * mask
    if cfg.in_loss:
        if correction == "none":
            weights = mask
        else:
            level = "token" if correction == "token-is" else "prefix"
            weights = importance_weights(logprobs, proposal, mask, level)
        per_token = per_token + weights * kl
    return per_token


# ---------------------------------------------------------------- estimators via the production loss

@dataclass(frozen=True)
class ToyRun:
    """One row of the study: a KL configuration (KLConfig or ExactKL), whether samples come from A_old."""

    name: str
    kl: KLConfig | ExactKL
    off_policy: bool = False


def default_runs() -> list:
    """K1/K2/K3/exact x reward/loss/reward+loss on-policy, then off-policy under each correction."""
    runs = []
    grid = [(est, pl) for est in ("k1", "k2", "k3") for pl in ("reward", "loss", "reward+loss")]
    placements = ("reward", "loss", "reward+loss")
    for est, pl in grid:
        runs.append(ToyRun(f"{est}/{pl}", KLConfig(est, pl, coef=1.0)))
    runs.append(ToyRun("k1/reward rtg", KLConfig("k1", "reward", coef=1.0, reward_to_go=True)))
    for pl in placements:
        runs.append(ToyRun(f"exact/{pl}", ExactKL(pl)))
    for pl in ("reward", "reward+loss"):
        for ret in ("to-go", "later"):
            runs.append(ToyRun(f"exact/{pl} {ret}", ExactKL(pl, ret)))
    for corr in ("none", "token-is", "seq-is"):
        for est, pl in grid:
            kl = KLConfig(est, pl, coef=1.0, off_policy_correction=corr)
            runs.append(ToyRun(f"{est}/{pl} off:{corr}", kl, off_policy=True))
        for pl in placements:
            runs.append(ToyRun(f"exact/{pl} off:{corr}", ExactKL(pl, off_policy_correction=corr), True))
    seq_is = KLConfig("k1", "reward", coef=1.0, off_policy_correction="seq-is")
    runs.append(ToyRun("k1/reward off:seq-is rtg", replace(seq_is, reward_to_go=True), True))
    runs.append(ToyRun("k1/reward off:seq-is trunc2", replace(seq_is, is_truncation=2.0), True))
    runs.append(ToyRun("exact/reward+loss off:seq-is later",
                       ExactKL("reward+loss", "later", "seq-is"), True))
    for est in ("k1", "k3"):
        kl = KLConfig(est, "loss", coef=1.0, off_policy_correction="token-is", is_weight_grad=True)
        runs.append(ToyRun(f"{est}/loss off:token-is grad", kl, True))
    return runs


def estimator_gradients(policy: BinaryARPolicy, ref_policy: BinaryARPolicy, y: torch.Tensor,
                        kl_cfg: KLConfig | ExactKL, old_policy: BinaryARPolicy | None = None,
                        return_baseline: torch.Tensor | None = None,
                        rollout_policy: BinaryARPolicy | None = None,
                        pg_correction: RolloutCorrectionConfig | None = None,
                        loss_mask: torch.Tensor | None = None,
                        old_logprobs: torch.Tensor | None = None,
                        loss: LossConfig | None = None,
                        rollout_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient [K, 2] (d/da, d/db) of the configuration's loss per parameter copy of `policy`.

    y [K, N, T] (or [1, N, T]): the sequences; old_policy: the sampling policy when off-policy
    (None: on-policy, old_logprobs = logprobs detached). The loss of copy k is the mean over its
    N sequences of the sequence-level objective (a Monte-Carlo estimate; N = 1: one sequence's
    gradient, as `exact_gradient_moments` uses it). return_baseline: a constant b (scalar, or
    [T] for per-token returns) subtracted from the reward-side KL penalty R inside the advantage,
    which becomes -(R - b); unbiased on- and off-policy, since the sampler's
    E[ratio_t s_t | y_<t] = 0.
    rollout_policy: mu, the engine's distribution, when it differs from the PPO ratio's pi_old
    (the three-distribution study): its log-probs are the trainer's rollout_logprobs, which the
    KL's importance weights divide by under is_proposal "rollout". pg_correction: the trainer's
    --rollout-correction, weights pi_old/mu on the policy-gradient term (needs rollout_policy).
    loss_mask [K or 1, N, T]: the trainer's loss_mask, 1 at the tokens the loss counts (None: all
    ones); the trajectory study passes the policy's tokens (environment tokens 0) or all tokens.
    old_logprobs [K or 1, N, T]: the PPO ratio's denominator (and the importance weights'), in
    place of old_policy(y) (the trajectory study folds environment-token ratios into it).
    loss: the policy loss of the policy-loss study (its policy_loss, clip range, clip_ratio_c,
    sapo temperatures and aggregation; its KL and advantage estimator are replaced by kl_cfg and
    "reinforce"); None: ppo-clip with clipping off, aggregated "seq-mean-token-sum". Not for
    the `exact` estimator, which runs with the None loss only.
    rollout_logprobs [K or 1, N, T]: the trainer's rollout_logprobs, in place of
    rollout_policy(y) (the versions study: each token's log-prob under the version that
    sampled it, or under the one version a wrong record would hold).
    """
    if loss is None:
        loss = LossConfig(clip_low=1.0, clip_high=math.inf, aggregation="seq-mean-token-sum")
    elif isinstance(kl_cfg, ExactKL):
        raise ValueError("the toy's exact estimator runs with ppo-clip unclipped only (loss=None)")
    logprobs = policy(y)
    num_copies, num_seqs, seq_len = logprobs.shape
    with torch.no_grad():
        ref_logits = ref_policy.logits(y)
        ref = ref_policy(y).expand_as(logprobs)
        if old_logprobs is not None:
            old = old_logprobs.expand_as(logprobs)
        else:
            old = (old_policy(y) if old_policy is not None else logprobs).expand_as(logprobs)
        if rollout_logprobs is not None:
            rollout = rollout_logprobs.expand_as(logprobs)
        else:
            rollout = rollout_policy(y).expand_as(logprobs) if rollout_policy is not None else None

    def flat(x):
        return x.reshape(num_copies * num_seqs, seq_len)

    if loss_mask is None:
        mask = torch.ones(num_copies * num_seqs, seq_len, dtype=DTYPE)
    else:
        mask = flat(loss_mask.to(DTYPE).expand_as(logprobs))
    rollout_lp = flat(rollout) if rollout is not None else None
    is_weights = None
    if pg_correction is not None and pg_correction.enabled:
        if rollout_lp is None:
            raise ValueError("a rollout correction needs rollout_policy or rollout_logprobs (mu)")
        is_weights = rollout_correction_weights(flat(old), rollout_lp, mask, pg_correction)[0]
    if isinstance(kl_cfg, ExactKL):
        kl = bernoulli_kl(policy.logits(y), ref_logits)
        per_token = exact_kl_loss_per_token(flat(logprobs), flat(old), flat(kl), mask, kl_cfg,
                                            return_baseline, rollout_lp, is_weights)
    else:
        cfg = replace(loss, kl=kl_cfg, advantage_estimator="reinforce")
        rewards = torch.zeros(num_copies * num_seqs, dtype=DTYPE)
        advantages = build_advantages(rewards, flat(logprobs).detach(), flat(ref), mask, cfg,
                                      group_size=1)
        if return_baseline is not None:  # reinforce: advantage = return, so subtract b here
            advantages = advantages + return_baseline * (mask if advantages.dim() == 2 else 1)
        per_token, _ = policy_loss_per_token(flat(logprobs), flat(old), advantages, mask, cfg,
                                             ref_logprobs=flat(ref), is_weights=is_weights,
                                             rollout_logprobs=rollout_lp)
    # Copies share nothing, so the gradient of the summed loss w.r.t. copy k is copy k's gradient.
    total = aggregate_loss(per_token, mask, loss.aggregation, num_global_seqs=num_seqs)
    grad_a, grad_b = torch.autograd.grad(total, [policy.a, policy.b])
    return torch.stack([grad_a, grad_b], dim=-1)


@torch.no_grad()
def kl_penalty_returns(policy: BinaryARPolicy, ref_policy: BinaryARPolicy, y: torch.Tensor,
                       kl_cfg: KLConfig | ExactKL) -> torch.Tensor:
    """The reward-side KL penalty [K*N] or [K*N, T] a configuration puts in the advantage (>= 0 for
    K3/exact; the advantage is minus this); zeros when the KL is not inside the advantage."""
    logprobs = policy(y)
    ref = ref_policy(y).expand_as(logprobs)
    flat_shape = (-1, y.shape[-1])
    mask = torch.ones(logprobs.reshape(flat_shape).shape, dtype=DTYPE)
    if isinstance(kl_cfg, ExactKL):
        if not kl_cfg.in_reward or kl_cfg.off_policy_correction == "seq-is":
            return torch.zeros(mask.shape[0], dtype=DTYPE)
        kl = bernoulli_kl(policy.logits(y), ref_policy.logits(y)).reshape(flat_shape)
        return _kl_returns(kl, kl_cfg.kl_return)
    rewards = torch.zeros(mask.shape[0], dtype=DTYPE)
    return -compute_rewards_with_kl(rewards, logprobs.reshape(flat_shape), ref.reshape(flat_shape),
                                    mask, kl_cfg)


def enumerated_kl(theta, ref, seq_len, model: str = "count") -> float:
    """KL(A_theta || B) by exact enumeration: sum_y A(y) log(A(y) / B(y))."""
    y = all_sequences(seq_len)
    with torch.no_grad():
        lp = BinaryARPolicy(*theta, model=model)(y).sum(-1)
        lq = BinaryARPolicy(*ref, model=model)(y).sum(-1)
    return (lp.exp() * (lp - lq)).sum().item()


def enumerated_kl_gradient(theta, ref, seq_len, model: str = "count") -> torch.Tensor:
    """g* [2] by exact enumeration: grad sum_y A(y) log(A(y) / B(y))."""
    policy, ref_policy = BinaryARPolicy(*theta, model=model), BinaryARPolicy(*ref, model=model)
    y = all_sequences(seq_len)
    seq_logprobs = policy(y).sum(-1)
    kl = (seq_logprobs.exp() * (seq_logprobs - ref_policy(y).sum(-1).detach())).sum()
    return torch.stack(torch.autograd.grad(kl, [policy.a, policy.b]), dim=-1).squeeze(0)


def exact_gradient_moments(theta, ref, seq_len, kl_cfg, old=None, model: str = "count",
                           baseline: bool = False, rollout=None,
                           pg_correction: RolloutCorrectionConfig | None = None):
    """(E[grad] [2], per-sample variance) by enumerating all 2^T sequences (weights A_theta or A_old).

    One parameter copy per sequence gives every single-sequence gradient g(y) in one backward pass;
    E = sum_y w(y) g(y), variance = sum_y w(y) |g(y) - E|^2 (trace of the covariance).
    baseline: subtract the mean KL penalty b = sum_y w(y) R(y) (per position for per-token returns)
    inside the advantage: the large-group limit of a leave-one-out (RLOO) baseline. Same E[grad].
    rollout: parameters of mu; when given the sequences are weighted by mu (the sampler) while
    old stays the PPO ratio's denominator (None: pi_old = A_theta); pg_correction as in
    `estimator_gradients`.
    """
    y = all_sequences(seq_len).transpose(0, 1)  # [2^T, 1, T]: one sequence per copy
    policy = BinaryARPolicy(*theta, num_copies=y.shape[0], model=model)
    ref_policy = BinaryARPolicy(*ref, model=model)
    old_policy = BinaryARPolicy(*old, model=model) if old is not None else None
    rollout_policy = BinaryARPolicy(*rollout, model=model) if rollout is not None else None
    with torch.no_grad():
        sampler = old_policy if old_policy is not None else BinaryARPolicy(*theta, model=model)
        if rollout_policy is not None:
            sampler = rollout_policy
        weights = sampler(y).sum(-1).exp().reshape(-1)
    b = weights @ kl_penalty_returns(policy, ref_policy, y, kl_cfg) if baseline else None
    grads = estimator_gradients(policy, ref_policy, y, kl_cfg, old_policy, b, rollout_policy,
                                pg_correction)
    mean = weights @ grads
    variance = (weights * (grads - mean).square().sum(-1)).sum().item()
    return mean, variance


def exact_expected_gradient(theta, ref, seq_len, kl_cfg, old=None, model: str = "count") -> torch.Tensor:
    """E[gradient estimate] [2] by summing over all 2^T sequences (weights A_theta or A_old)."""
    return exact_gradient_moments(theta, ref, seq_len, kl_cfg, old, model)[0]


# ---------------------------------------------------------------- the study

# Default (theta, ref, old) per model. count: b is a quarter of the sign model's, so that b c over
# c = 0..7 spans about the range b c does in the sign model (c = +-1); KL(A_theta || B) = 0.51 nats.
DEFAULT_PARAMS = {"count": ((0.5, -0.25), (-0.5, 0.25), (0.9, -0.15)),
                  "sign": ((0.5, -1.0), (-0.5, 1.0), (0.9, -0.6))}
# Default environment kernel (e0, e1) of the trajectory study per model, parameterised as the
# policy: E(x_t = 1 | h_t) = sigmoid(e0 + e1 c_{t-1}), unlike A_theta's and B's conditionals at
# the histories where the environment acts. (Where the kernel equals A_theta's conditional, the
# trajectory law is the policy's own over all T tokens, and charging its tokens is right for
# that law's KL: the sign model's call layout with kernel (1, -1.5) is such a case.)
DEFAULT_ENV = {"count": (1.0, -0.5), "sign": (1.5, -0.5)}
# (theta, ref) pairs of the variance comparison, from close to far from the reference.
VARIANCE_SETTINGS = (((0.3, 0.1), (-0.3, 0.3)), ((1.0, -0.5), (0.5, -0.2)), ((0.3, -0.2), (-0.3, 0.2)),
                     ((0.5, -0.25), (-0.5, 0.25)), ((0.5, -0.5), (-0.5, 0.5)), ((0.5, -1.0), (-0.5, 1.0)))


@dataclass
class ToySetup:
    """Model, parameters (a, b) of A_theta, B (reference) and A_old (off-policy sampler); MC sizes."""

    seq_len: int = 8
    theta: tuple = DEFAULT_PARAMS["count"][0]
    ref: tuple = DEFAULT_PARAMS["count"][1]
    old: tuple = DEFAULT_PARAMS["count"][2]
    model: str = "count"
    num_trials: int = 200
    num_samples: int = 1000
    seed: int = 0
    runs: list = field(default_factory=default_runs)
    variance_settings: tuple = VARIANCE_SETTINGS
    rollout: tuple | None = None  # mu's (a, b): adds the three-distribution study when set
    is_truncation: float = 2.0  # c of its truncated weights, min(w, c)
    versions: tuple | None = None  # ((a, b) older, (a, b) newer): adds the versions study when set
    switch: str = "random"  # its switch law, a `switch_branches` rule
    env_tokens: str | None = None  # an ENV_LAYOUTS entry: adds the trajectory study when set
    env: tuple | None = None  # the environment kernel's (e0, e1); None: DEFAULT_ENV[model]
    policy_losses: tuple | None = None  # POLICY_LOSS_NAMES entries: adds the policy-loss study
    loss_aggregation: str = "seq-mean-token-sum"  # a STUDY_AGGREGATIONS entry, for that study
    stop_after: int | None = None  # that study's sequences end with their K-th one; None: at T


def _run_key(run: ToyRun) -> str:
    return f"{run.kl.estimator}/{run.kl.placement}"


def variance_sweep(settings, seq_len: int, model: str = "count", runs=None) -> list:
    """Exact per-sample variance (no baseline, mean baseline) of the VARIANCE_SUMMARY configurations,
    on-policy, at each (theta, ref) of settings: [{theta, ref, kl, rows: {config: {...}}}]."""
    runs = [r for r in (runs or default_runs()) if r.name in VARIANCE_SUMMARY and not r.off_policy]
    out = []
    for theta, ref in settings:
        g_star = true_gradient(theta, ref, seq_len, model)
        rows = {}
        for run in runs:
            mean, variance = exact_gradient_moments(theta, ref, seq_len, run.kl, model=model)
            _, variance_b = exact_gradient_moments(theta, ref, seq_len, run.kl, model=model, baseline=True)
            rows[run.name] = {"exact_sq_bias": (mean - g_star).square().sum().item(),
                              "variance": variance, "variance_mean_baseline": variance_b}
        out.append({"theta": list(theta), "ref": list(ref),
                    "kl": closed_form_kl(theta, ref, seq_len, model), "rows": rows})
    return out


# ---------------------------------------------------------------- three distributions (mu, pi_old, A_theta)

# (off-policy correction, proposal) of the KL's importance weights; "none" has no weights.
KL_COLUMNS = (("none", "behaviour"), ("token-is", "behaviour"), ("token-is", "rollout"),
              ("seq-is", "behaviour"), ("seq-is", "rollout"))
PROPOSAL_NAMES = {"behaviour": "pi_old", "rollout": "mu"}
# Rows whose seq-is weights are also measured truncated (ExactKL has no truncation option).
TRUNCATED_CONFIGS = ("k1/reward", "k1/reward rtg", "k1/reward+loss", "k3/reward+loss")
# Rows with the KL inside the advantage (correction "none"), under the policy-gradient corrections.
PG_CONFIGS = ("k1/reward", "k1/reward rtg", "k3/reward+loss", "exact/reward+loss later")


def three_distribution_configs() -> list:
    """Row names of the three-distribution study: estimator/placement, plus K1 in the reward with
    reward-to-go ("rtg") and exact in reward+loss with the later positions' return ("later")."""
    names = []
    for est in ("k1", "k2", "k3", "exact"):
        for placement in ("reward", "loss", "reward+loss"):
            names.append(f"{est}/{placement}")
            if (est, placement) == ("k1", "reward"):
                names.append("k1/reward rtg")
            if (est, placement) == ("exact", "reward+loss"):
                names.append("exact/reward+loss later")
    return names


def three_distribution_kl(name: str, correction: str, proposal: str,
                          truncation: float | None = None) -> KLConfig | ExactKL:
    """The KL configuration of row `name` under an off-policy correction and an IS proposal."""
    base, _, variant = name.partition(" ")
    estimator, placement = base.split("/")
    if estimator == "exact":
        if truncation is not None:
            raise ValueError("exact: no truncation option")
        return ExactKL(placement, "later" if variant == "later" else "full", correction, proposal)
    return KLConfig(estimator, placement, coef=1.0, reward_to_go=variant == "rtg",
                    off_policy_correction=correction, is_proposal=proposal,
                    is_truncation=truncation)


def pg_corrections(truncation: float) -> dict:
    """The trainer's --rollout-correction settings compared: none, tis untruncated and at c,
    seq-mis and icepop at their default bounds; keyed by a label with the bounds."""
    configs = [RolloutCorrectionConfig(), RolloutCorrectionConfig("tis", 0.0, math.inf),
               RolloutCorrectionConfig("tis", 0.0, truncation), RolloutCorrectionConfig("seq-mis"),
               RolloutCorrectionConfig("icepop")]
    out = {}
    for cfg in configs:
        low, high = cfg.bounds()
        out[cfg.mode if not cfg.enabled else f"{cfg.mode} [{low:g}, {high:g}]"] = cfg
    return out


def sequence_weight_moments(theta, old, rollout, seq_len: int, model: str = "count") -> dict:
    """Under mu, by enumeration: mean and second moment of the sequence weights pi_theta/pi_old
    (behaviour) and pi_theta/mu (rollout); KL(mu || pi_old) and KL(A_theta || mu), sequence level;
    the range of the token weights pi_old/mu (the policy-gradient correction's, before bounds)
    over every position of every sequence."""
    y = all_sequences(seq_len)
    with torch.no_grad():
        token_old, token_mu = (BinaryARPolicy(*params, model=model)(y)[0] for params in (old, rollout))
        lp_theta, lp_old, lp_mu = (BinaryARPolicy(*params, model=model)(y).sum(-1)[0]
                                   for params in (theta, old, rollout))
    token_w = (token_old - token_mu).exp()
    mu = lp_mu.exp()
    out = {}
    for proposal, lp_q in (("behaviour", lp_old), ("rollout", lp_mu)):
        w = (lp_theta - lp_q).exp()
        out[proposal] = {"mean": (mu * w).sum().item(), "second_moment": (mu * w.square()).sum().item()}
    out["kl_mu_old"] = (mu * (lp_mu - lp_old)).sum().item()
    out["kl_theta_mu"] = (lp_theta.exp() * (lp_theta - lp_mu)).sum().item()
    out["token_weight_range"] = [token_w.min().item(), token_w.max().item()]
    return out


def three_distribution_study(theta, ref, old, rollout, seq_len: int, model: str = "count",
                             truncation: float = 2.0) -> dict:
    """Exact bias^2 vs g* and per-sample variance, samples from mu = rollout, PPO ratio against
    pi_old = old, of every three_distribution_configs() row under each KL_COLUMNS entry; the
    TRUNCATED_CONFIGS under truncated seq-is weights (with the shift |E_c - E|^2 the truncation
    causes); the PG_CONFIGS under each pg_corrections() setting."""
    g_star = true_gradient(theta, ref, seq_len, model)

    def moments(kl_cfg, pg=None):
        mean, variance = exact_gradient_moments(theta, ref, seq_len, kl_cfg, old, model,
                                                rollout=rollout, pg_correction=pg)
        sq_bias = (mean - g_star).square().sum().item()
        return mean, {"exact_grad": mean.tolist(), "exact_sq_bias": sq_bias, "variance": variance,
                      "biased": sq_bias > UNBIASED_TOL}

    rows, untruncated = [], {}
    for name in three_distribution_configs():
        for correction, proposal in KL_COLUMNS:
            mean, stats = moments(three_distribution_kl(name, correction, proposal))
            untruncated[name, correction, proposal] = mean
            rows.append({"table": "kl", "config": name, "correction": correction,
                         "proposal": None if correction == "none" else proposal,
                         "is_truncation": None, "pg_correction": "none", **stats})
    for name in TRUNCATED_CONFIGS:
        for proposal in IS_PROPOSALS:
            mean, stats = moments(three_distribution_kl(name, "seq-is", proposal, truncation))
            shift = (mean - untruncated[name, "seq-is", proposal]).square().sum().item()
            rows.append({"table": "truncation", "config": name, "correction": "seq-is",
                         "proposal": proposal, "is_truncation": truncation, "pg_correction": "none",
                         **stats, "truncation_shift_sq": shift})
    for name in PG_CONFIGS:
        for label, pg in pg_corrections(truncation).items():
            _, stats = moments(three_distribution_kl(name, "none", "behaviour"), pg)
            rows.append({"table": "pg", "config": name, "correction": "none", "proposal": None,
                         "is_truncation": None, "pg_correction": label, **stats})
    return {"rollout": list(rollout), "old": list(old), "is_truncation": truncation,
            "sequence_weights": sequence_weight_moments(theta, old, rollout, seq_len, model),
            "rows": rows}


# ---------------------------------------------------------------- versions: one sample, several weight versions

# What a sample carries as its rollout_logprobs: each token's log-prob under the version that
# sampled it ("own"), or the newer version's at every token ("last": one mu for the whole
# sequence, what a record rescored after the weight update, or weights built from one version
# tag, would hold).
VERSION_RECORDS = ("own", "last")
# Columns of the versions study: (the KL's off-policy correction, its proposal, the record).
VERSION_COLUMNS = (("none", "behaviour", "own"), ("token-is", "rollout", "own"),
                   ("seq-is", "behaviour", "own"), ("seq-is", "rollout", "own"),
                   ("seq-is", "rollout", "last"))
VERSION_COLUMN_NAMES = {("none", "behaviour", "own"): "none",
                        ("token-is", "rollout", "own"): "token-is / mu_t",
                        ("seq-is", "behaviour", "own"): "seq-is / pi_old",
                        ("seq-is", "rollout", "own"): "seq-is / mu_t",
                        ("seq-is", "rollout", "last"): "seq-is / mu_B (one mu)"}
SWITCH_HELP = ("S: tokens 1..S from the older version, S+1..T from the newer (0 <= S <= T); "
               "random: S uniform on 0..T, drawn independently of the tokens (a weight update "
               "at a random time); ones:K: the older version until the K-th token 1, the newer "
               "after it (a switch at a point the tokens decide, e.g. a turn boundary)")


def switch_branches(y: torch.Tensor, switch: str) -> list:
    """The switch law of `--switch` on the sequences y [N, T]: a list of (prob [N], older [N, T]),
    one entry per switch outcome, prob = P(outcome | y) and older = 1 at the tokens the older
    version sampled. Every rule here is predictable: whether token t comes from the older
    version depends on y_<t (and on randomness independent of the tokens), never on y_>=t.

    S (an integer, 0..T): tokens t <= S (1-based) from the older version. random: each S in
    0..T with probability 1/(T+1). ones:K: the older version while fewer than K ones precede
    the token, so the update lands right after the K-th one (never, with fewer than K).
    """
    num_seqs, seq_len = y.shape
    pos = torch.arange(seq_len)
    one = torch.ones(num_seqs, dtype=DTYPE)

    def first(s: int) -> torch.Tensor:
        return (pos < s).to(DTYPE).expand(num_seqs, seq_len)

    kind, _, arg = switch.partition(":")
    if switch == "random":
        return [(one / (seq_len + 1), first(s)) for s in range(seq_len + 1)]
    if kind == "ones" and arg.isdigit() and int(arg) >= 1:
        return [(one, ((torch.cumsum(y, -1) - y) < int(arg)).to(DTYPE))]
    if switch.isdigit() and int(switch) <= seq_len:
        return [(one, first(int(switch)))]
    raise ValueError(f"--switch {switch!r}: valid: an integer S in [0, --seq-len {seq_len}], "
                     "'random', or 'ones:K' with K >= 1")


def mixed_version_logprobs(older, newer, y: torch.Tensor, older_mask: torch.Tensor,
                           model: str = "count") -> tuple:
    """(own, last) per-token log-probs [..., T] of sequences y whose tokens at older_mask 1 the
    older version sampled and the rest the newer: own_t = log mu_{v(t)}(y_t | y_<t), the
    record of each token's sampler; last_t = log mu_newer(y_t | y_<t) at every token."""
    with torch.no_grad():
        lp_older = BinaryARPolicy(*older, model=model)(y)
        lp_newer = BinaryARPolicy(*newer, model=model)(y)
    return older_mask * lp_older + (1 - older_mask) * lp_newer, lp_newer


def _version_samples(older, newer, seq_len: int, switch: str, model: str):
    """Every (sequence, switch outcome) pair as one sample: (y [M, 1, T], q [M] its probability
    under the mixed sampler, own [M, 1, T], last [M, 1, T] log-probs as in
    `mixed_version_logprobs`). M = 2^T x the number of switch outcomes; sum q = 1."""
    y = all_sequences(seq_len)[0]
    branches = switch_branches(y, switch)
    ys = torch.cat([y for _ in branches])[:, None, :]
    older_mask = torch.cat([mask for _, mask in branches])[:, None, :]
    prob = torch.cat([p for p, _ in branches])
    own, last = mixed_version_logprobs(older, newer, ys, older_mask, model)
    return ys, prob * own.sum(-1).exp().reshape(-1), own, last


def mixed_version_moments(theta, ref, old, older, newer, seq_len: int,
                          kl_cfg: KLConfig | ExactKL, switch: str = "random",
                          model: str = "count", record: str = "own",
                          pg_correction: RolloutCorrectionConfig | None = None):
    """(E_q[grad] [2], per-sample variance) over every (sequence, switch outcome), exactly.

    The sampler q of a mixed-version sample: token t from mu_{v(t)}, the older version's
    parameters `older` before the switch and the newer's `newer` after it (`switch_branches`),
    q(y, v) = P(v | y) prod_t mu_{v(t)}(y_t | y_<t). Each sample's gradient runs through the
    production loss (`estimator_gradients`) with rollout_logprobs = the record (`record`:
    "own", each token's sampler; "last", the newer version at every token) and the PPO ratio
    against pi_old = old (the trainer's recompute; None: pi_old := the record, as
    --old-logprobs rollout gives). pg_correction: the trainer's --rollout-correction on the
    record. E = sum q g, variance = sum q |g - E|^2, as `exact_gradient_moments`.
    """
    if record not in VERSION_RECORDS:
        raise ValueError(f"unknown record {record!r}; valid: {list(VERSION_RECORDS)}")
    ys, weights, own, last = _version_samples(older, newer, seq_len, switch, model)
    recorded = own if record == "own" else last
    policy = BinaryARPolicy(*theta, num_copies=ys.shape[0], model=model)
    old_policy = BinaryARPolicy(*old, model=model) if old is not None else None
    grads = estimator_gradients(policy, BinaryARPolicy(*ref, model=model), ys, kl_cfg, old_policy,
                                pg_correction=pg_correction,
                                old_logprobs=recorded if old is None else None,
                                rollout_logprobs=recorded)
    mean = weights @ grads
    variance = (weights * (grads - mean).square().sum(-1)).sum().item()
    return mean, variance


def version_weight_moments(theta, old, older, newer, seq_len: int, switch: str,
                           model: str = "count") -> dict:
    """Under the mixed sampler q, by enumeration: for each record (own, last) the mean and second
    moment of the sequence weight W = pi_theta(y) / exp(sum_t record_t) (own: pi_theta/q, mean
    1, second moment 1 + chi^2(pi_theta || q)) and the mean per-token |log pi_old - record_t|
    (the trainer's rollout_corr/log_ratio_abs_mean); KL(q || pi_old) over sequences."""
    ys, q, own, last = _version_samples(older, newer, seq_len, switch, model)
    with torch.no_grad():
        lp_theta, lp_old = (BinaryARPolicy(*params, model=model)(ys) for params in (theta, old))
    out = {}
    for record, lp in (("own", own), ("last", last)):
        w = (lp_theta.sum(-1) - lp.sum(-1)).exp().reshape(-1)
        out[record] = {"mean": (q @ w).item(), "second_moment": (q @ w.square()).item(),
                       "log_ratio_abs": (q @ (lp_old - lp).abs().mean(-1).reshape(-1)).item()}
    out["kl_q_old"] = (q @ (own.sum(-1) - lp_old.sum(-1)).reshape(-1)).item()
    return out


# Rows of the by-switch-point table: K1 in the reward (the placement the trainer defaults to).
SWITCH_SWEEP_CONFIG = "k1/reward"


def versions_study(theta, ref, old, older, newer, seq_len: int, model: str = "count",
                   switch: str = "random", truncation: float = 2.0) -> dict:
    """Exact bias^2 vs g* and per-sample variance on mixed-version samples (`mixed_version_moments`):
    every three_distribution_configs() row under each VERSION_COLUMNS entry; the PG_CONFIGS (KL
    inside the advantage) under each pg_corrections() setting on each token's own record; and,
    for each fixed switch point S = 0..T, K1 in the reward under seq-is with the own record
    and with the last, beside the weights' moments (`version_weight_moments`)."""
    g_star = true_gradient(theta, ref, seq_len, model)

    def moments(kl_cfg, record="own", pg=None, at=switch):
        mean, variance = mixed_version_moments(theta, ref, old, older, newer, seq_len, kl_cfg, at,
                                               model, record, pg)
        sq_bias = (mean - g_star).square().sum().item()
        return {"exact_grad": mean.tolist(), "exact_sq_bias": sq_bias, "variance": variance,
                "biased": sq_bias > UNBIASED_TOL}

    rows = []
    for name in three_distribution_configs():
        for correction, proposal, record in VERSION_COLUMNS:
            rows.append({"table": "kl", "config": name, "correction": correction,
                         "proposal": proposal, "record": record, "pg_correction": "none",
                         **moments(three_distribution_kl(name, correction, proposal), record)})
    for name in PG_CONFIGS:
        for label, pg in pg_corrections(truncation).items():
            rows.append({"table": "pg", "config": name, "correction": "none",
                         "proposal": "behaviour", "record": "own", "pg_correction": label,
                         **moments(three_distribution_kl(name, "none", "behaviour"), pg=pg)})
    by_switch = []
    for s in range(seq_len + 1):
        entry = {"switch": s, "weights": version_weight_moments(theta, old, older, newer, seq_len,
                                                                str(s), model)}
        for record in VERSION_RECORDS:
            kl = three_distribution_kl(SWITCH_SWEEP_CONFIG, "seq-is", "rollout")
            entry[record] = moments(kl, record, at=str(s))
        by_switch.append(entry)
    return {"older": list(older), "newer": list(newer), "old": list(old), "switch": switch,
            "is_truncation": truncation,
            "weights": version_weight_moments(theta, old, older, newer, seq_len, switch, model),
            "rows": rows, "by_switch": by_switch}


# ---------------------------------------------------------------- trajectories: environment tokens

ENV_LAYOUTS = ("call", "alternate")
# What the loss_mask of the trajectory study holds: the policy's tokens only (the trainer's),
# every token, or the policy's tokens with the environment tokens' ratios in the seq-is weights.
TRAJECTORY_MASKS = ("masked", "charged", "env-in-weights")
# Columns of the trajectory study: (sampling, the KL's off-policy correction, loss_mask).
TRAJECTORY_COLUMNS = (("on-policy", "none", "masked"), ("on-policy", "none", "charged"),
                      ("off-policy", "none", "masked"), ("off-policy", "none", "charged"),
                      ("off-policy", "token-is", "masked"), ("off-policy", "token-is", "charged"),
                      ("off-policy", "seq-is", "masked"), ("off-policy", "seq-is", "charged"),
                      ("off-policy", "seq-is", "env-in-weights"))
SINGLE_TURN_REGIMES = (("on-policy", "none"), ("off-policy", "none"), ("off-policy", "token-is"),
                       ("off-policy", "seq-is"))


def policy_token_mask(y: torch.Tensor, layout: str) -> torch.Tensor:
    """[..., L] float64, 1 at the policy's tokens and 0 at the environment's, from y [..., L].

    Which positions are the environment's is a function of the prefix:
    alternate: policy, environment, policy, ... (a tool's output after every policy token);
    call: the first token is the policy's; after a policy token 1 (a tool call) comes one
        environment token (the tool's output), then the policy again; after a policy token 0 the
        policy goes on. The number of policy tokens then varies between trajectories.
    """
    num_tokens = y.shape[-1]
    if layout == "alternate":
        return (torch.arange(num_tokens) % 2 == 0).to(DTYPE).expand_as(y).clone()
    if layout == "call":
        cols = [torch.ones_like(y[..., 0])]
        for t in range(1, num_tokens):
            cols.append(1 - cols[-1] * y[..., t - 1])
        return torch.stack(cols, dim=-1)
    raise ValueError(f"unknown environment layout {layout!r}; valid: {list(ENV_LAYOUTS)}")


def trajectory_logprobs(policy: BinaryARPolicy, env: BinaryARPolicy, y: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs [K, N, L] of the trajectory law P: the policy's at its tokens (mask 1),
    the environment kernel's at the others. P(tau) = exp of their sum."""
    return mask * policy(y) + (1 - mask) * env(y)


def _trajectory_policies(theta, ref, env, model):
    return (BinaryARPolicy(*theta, model=model), BinaryARPolicy(*ref, model=model),
            BinaryARPolicy(*env, model=model))


def trajectory_kl(theta, ref, env, seq_len: int, model: str = "count", layout: str = "call",
                  per_position: bool = False) -> float:
    """KL(P_theta || P_ref) over all 2^L trajectories, both laws with the same environment kernel.

    per_position False: sum_tau P_theta(tau) log(P_theta(tau) / P_ref(tau)), the environment's
    factors kept in both laws (their cancellation is not assumed). True: E_theta[sum over the
    policy's tokens t of KL(A_theta(.|h_t) || B(.|h_t))], the per-position form.
    """
    y = all_sequences(seq_len)
    mask = policy_token_mask(y, layout)
    policy, ref_policy, env_policy = _trajectory_policies(theta, ref, env, model)
    with torch.no_grad():
        lp = trajectory_logprobs(policy, env_policy, y, mask).sum(-1)
        if per_position:
            kl = (bernoulli_kl(policy.logits(y), ref_policy.logits(y)) * mask).sum(-1)
            return (lp.exp() * kl).sum().item()
        lq = trajectory_logprobs(ref_policy, env_policy, y, mask).sum(-1)
    return (lp.exp() * (lp - lq)).sum().item()


def trajectory_kl_gradient(theta, ref, env, seq_len: int, model: str = "count",
                           layout: str = "call") -> torch.Tensor:
    """g* [2] = grad KL(P_theta || P_ref) by autograd through the enumerated KL (environment
    factors in both laws, the environment's and the reference's parameters held)."""
    y = all_sequences(seq_len)
    mask = policy_token_mask(y, layout)
    policy, ref_policy, env_policy = _trajectory_policies(theta, ref, env, model)
    lp = trajectory_logprobs(policy, env_policy, y, mask).sum(-1)
    with torch.no_grad():
        lq = trajectory_logprobs(ref_policy, env_policy, y, mask).sum(-1)
    kl = (lp.exp() * (lp - lq)).sum()
    return torch.stack(torch.autograd.grad(kl, [policy.a, policy.b]), dim=-1).squeeze(0)


def trajectory_kl_gradient_score(theta, ref, env, seq_len: int, model: str = "count",
                                 layout: str = "call") -> torch.Tensor:
    """g* [2] by the score-function identity, without autograd:
        g* = sum_tau P_theta(tau) log(P_theta(tau) / P_ref(tau)) S(tau),
        S(tau) = sum over the policy's tokens t of (x_t - p_t) (1, c_{t-1}),
    the score grad log P_theta(tau): d/dz log sigmoid((2x - 1) z) = x - sigmoid(z), z = a + b c,
    and the environment's factors carry no theta."""
    y = all_sequences(seq_len)
    mask = policy_token_mask(y, layout)
    policy, ref_policy, env_policy = _trajectory_policies(theta, ref, env, model)
    with torch.no_grad():
        lp = trajectory_logprobs(policy, env_policy, y, mask).sum(-1)[0]
        lq = trajectory_logprobs(ref_policy, env_policy, y, mask).sum(-1)[0]
        dz = ((y - torch.sigmoid(policy.logits(y))) * mask)[0]
        score = torch.stack([dz.sum(-1), (dz * prefix_features(y, model)[0]).sum(-1)], dim=-1)
    return (lp.exp() * (lp - lq)) @ score


def _fold_env_ratios(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """old_logprobs [..., L] with each environment token's log-ratio log(pi_theta/pi_old)(x_s|h_s)
    moved onto the next policy token, so that the production prefix weights (products over the
    loss_mask) at a policy token t multiply the ratios of every token before it, the environment's
    included (environment tokens after the last policy token enter no weight). The PPO ratio of
    that token changes too, which changes nothing under seq-is with zero task reward: there the
    advantage is zero."""
    env_log_ratio = (logprobs - old_logprobs) * (1 - mask)
    carry = torch.zeros_like(logprobs[..., 0])
    folded = []
    for t in range(logprobs.shape[-1]):
        folded.append(carry * mask[..., t])
        carry = carry * (1 - mask[..., t]) + env_log_ratio[..., t]
    return old_logprobs - torch.stack(folded, dim=-1)


def trajectory_gradient_moments(theta, ref, env, seq_len: int, kl_cfg: KLConfig | ExactKL,
                                mask_mode: str = "masked", old=None, model: str = "count",
                                layout: str = "call"):
    """(E[grad] [2], per-sample variance) over all 2^L trajectories, through the production loss.

    Trajectories tau ~ P_theta (old None) or P_old (old: the policy's tokens from A_old, the
    environment's from the same kernel); per-trajectory gradients as `exact_gradient_moments`.
    mask_mode: the loss_mask given to the loss: "masked" = the policy's tokens (environment tokens
    enter only as conditioning); "charged" = every token (the environment's are scored as if the
    policy had sampled them: their K_t from the policies' log-probs of a token neither chose,
    their score, loss term and importance ratio; the PPO ratio's denominator there is pi_old's
    log-prob of the token, as a trainer's recompute gives); "env-in-weights" = the policy's
    tokens, with the environment tokens' ratios folded into the importance weights
    (`_fold_env_ratios`; differs from "masked" only off-policy under seq-is).
    """
    if mask_mode not in TRAJECTORY_MASKS:
        raise ValueError(f"unknown mask mode {mask_mode!r}; valid: {list(TRAJECTORY_MASKS)}")
    y = all_sequences(seq_len).transpose(0, 1)  # [2^L, 1, L]: one trajectory per copy
    mask = policy_token_mask(y, layout)
    policy = BinaryARPolicy(*theta, num_copies=y.shape[0], model=model)
    _, ref_policy, env_policy = _trajectory_policies(theta, ref, env, model)
    old_policy = BinaryARPolicy(*old, model=model) if old is not None else None
    old_logprobs = None
    with torch.no_grad():
        sampler = old_policy if old_policy is not None else BinaryARPolicy(*theta, model=model)
        weights = trajectory_logprobs(sampler, env_policy, y, mask).sum(-1).exp().reshape(-1)
        if mask_mode == "env-in-weights":
            old_logprobs = _fold_env_ratios(policy(y), sampler(y), mask)
    loss_mask = torch.ones_like(mask) if mask_mode == "charged" else mask
    grads = estimator_gradients(policy, ref_policy, y, kl_cfg, old_policy, loss_mask=loss_mask,
                                old_logprobs=old_logprobs)
    mean = weights @ grads
    variance = (weights * (grads - mean).square().sum(-1)).sum().item()
    return mean, variance


def trajectory_study(theta, ref, old, env, seq_len: int, model: str = "count",
                     layout: str = "call") -> dict:
    """Exact bias^2 against g* = grad KL(P_theta || P_ref) and per-sample variance of every
    three_distribution_configs() row in each TRAJECTORY_COLUMNS entry; beside them, in which
    SINGLE_TURN_REGIMES the single-turn study (no environment tokens, same T) finds the row
    unbiased, and each row's bias^2 against the gradient of KL(A_theta || B) over all L tokens."""
    g_star = trajectory_kl_gradient(theta, ref, env, seq_len, model, layout)
    g_score = trajectory_kl_gradient_score(theta, ref, env, seq_len, model, layout)
    kl = trajectory_kl(theta, ref, env, seq_len, model, layout)
    kl_per_position = trajectory_kl(theta, ref, env, seq_len, model, layout, per_position=True)
    g_all = true_gradient(theta, ref, seq_len, model)
    rows, single_turn = [], []
    for name in three_distribution_configs():
        for sampling, correction, mask_mode in TRAJECTORY_COLUMNS:
            mean, variance = trajectory_gradient_moments(
                theta, ref, env, seq_len, three_distribution_kl(name, correction, "behaviour"),
                mask_mode, old if sampling == "off-policy" else None, model, layout)
            sq_bias = (mean - g_star).square().sum().item()
            rows.append({"config": name, "sampling": sampling, "correction": correction,
                         "mask": mask_mode, "exact_grad": mean.tolist(), "exact_sq_bias": sq_bias,
                         "variance": variance, "biased": sq_bias > UNBIASED_TOL,
                         "sq_bias_vs_all_tokens": (mean - g_all).square().sum().item()})
        for sampling, correction in SINGLE_TURN_REGIMES:
            mean, _ = exact_gradient_moments(theta, ref, seq_len,
                                             three_distribution_kl(name, correction, "behaviour"),
                                             old if sampling == "off-policy" else None, model)
            sq_bias = (mean - g_all).square().sum().item()
            single_turn.append({"config": name, "sampling": sampling, "correction": correction,
                                "exact_sq_bias": sq_bias, "biased": sq_bias > UNBIASED_TOL})
    y = all_sequences(seq_len)
    mask = policy_token_mask(y, layout)
    with torch.no_grad():
        policy_tokens = {
            label: (trajectory_logprobs(BinaryARPolicy(*params, model=model),
                                        BinaryARPolicy(*env, model=model), y, mask).sum(-1).exp()
                    * mask.sum(-1)).sum().item()
            for label, params in (("theta", theta), ("old", old))}
    return {"layout": layout, "env": list(env), "seq_len": seq_len, "kl": kl,
            "kl_per_position_abs_err": abs(kl_per_position - kl),
            "true_gradient": g_star.tolist(),
            "true_gradient_score_abs_err": (g_score - g_star).abs().max().item(),
            "all_tokens_kl": closed_form_kl(theta, ref, seq_len, model),
            "all_tokens_gradient": g_all.tolist(), "mean_policy_tokens": policy_tokens,
            "rows": rows, "single_turn": single_turn}


# ---------------------------------------------------------------- per-turn rewards

TURN_CREDITS = ("sum", "to-go", "last-turn", "to-date")
TOOL_REWARD = 0.25  # the environment's reward for a call whose answer is 1


def reward_events(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[..., L] the rewards of a trajectory at the positions they are given, 0 elsewhere: at each
    environment token (the answer to the turn before it) TOOL_REWARD x its token, and at the last
    position, where it is the policy's, its token (the final answer). Position p's reward is
    the reward of policy turn `turn_index` p (the turn the environment token answers, or the
    last turn): turn j's reward R_j is the sum of its events, the agent loop's turn_rewards[j]."""
    events = TOOL_REWARD * y * (1 - mask)
    events[..., -1] = events[..., -1] + y[..., -1] * mask[..., -1]
    return events


def turn_index(mask: torch.Tensor) -> torch.Tensor:
    """[..., L] the policy turn of each position: the number of environment tokens before it (a
    turn is a run of the policy's tokens; an environment token answers the turn before it)."""
    env = 1 - mask
    return torch.cumsum(env, dim=-1) - env


def turn_credit_returns(events: torch.Tensor, mask: torch.Tensor, credit: str) -> torch.Tensor:
    """The task return each policy token is credited with under `credit`, [..., L] (0 at the
    environment's tokens), from reward_events' `events`. With token t in policy turn k(t):
        sum        sum_j R_j            (the agent loop's rule: the trajectory's reward)
        to-go      sum_{j >= k(t)} R_j  (the events at positions >= t)
        last-turn  R_last               (the last turn's reward alone)
        to-date    sum_{j <= k(t)} R_j  (a turn credited with the rewards before it: biased)"""
    turns = turn_index(mask)
    if credit == "sum":
        out = events.sum(-1, keepdim=True).expand_as(events)
    elif credit == "to-go":
        out = events.flip(-1).cumsum(-1).flip(-1)
    elif credit == "last-turn":
        out = events[..., -1:].expand_as(events)
    elif credit == "to-date":
        later = turns.unsqueeze(-2) > turns.unsqueeze(-1)  # [.., t, p]: p's turn after t's
        out = events.sum(-1, keepdim=True) - (later * events.unsqueeze(-2)).sum(-1)
    else:
        raise ValueError(f"unknown turn credit {credit!r}; valid: {list(TURN_CREDITS)}")
    return out * mask


def turn_reward_objective_gradient(theta, ref, env, seq_len: int, model: str = "count",
                                   layout: str = "call", beta: float = 1.0) -> torch.Tensor:
    """grad J [2], J(theta) = E_theta[sum_j R_j] - beta KL(P_theta || P_ref), by autograd through
    the enumeration of all 2^L trajectories (the environment's factors in both laws)."""
    y = all_sequences(seq_len)
    mask = policy_token_mask(y, layout)
    policy, ref_policy, env_policy = _trajectory_policies(theta, ref, env, model)
    lp = trajectory_logprobs(policy, env_policy, y, mask).sum(-1)
    with torch.no_grad():
        lq = trajectory_logprobs(ref_policy, env_policy, y, mask).sum(-1)
        total = reward_events(y, mask).sum(-1)
    objective = (lp.exp() * (total - beta * (lp - lq))).sum()
    return torch.stack(torch.autograd.grad(objective, [policy.a, policy.b]), dim=-1).squeeze(0)


def turn_credit_moments(theta, ref, env, seq_len: int, credit: str, model: str = "count",
                        layout: str = "call", beta: float = 1.0):
    """(E[grad] [2], per-sample variance) of the policy gradient under `credit`, on-policy over
    all 2^L trajectories, through the production code: K1 in the reward (coef beta) over the
    policy's tokens (loss_mask = the policy's tokens), REINFORCE, ppo-clip unclipped. "sum" and
    "last-turn" give one return per trajectory (build_advantages with that reward, the KL summed
    over the trajectory); "to-go" is the trainer's --turn-credit to-go with --kl-reward-to-go
    (build_advantages with the rewards at their positions, loss.turn_rewards_to_go); "to-date"
    the KL to go (compute_rewards_with_kl) plus the credited task return, through
    compute_advantages as per-token returns. Returns the minimized loss's gradient negated: an
    estimate of grad J."""
    y = all_sequences(seq_len).transpose(0, 1)  # [2^L, 1, L]: one trajectory per copy
    mask = policy_token_mask(y, layout)
    num = y.shape[0]
    policy = BinaryARPolicy(*theta, num_copies=num, model=model)
    _, ref_policy, env_policy = _trajectory_policies(theta, ref, env, model)
    with torch.no_grad():
        weights = trajectory_logprobs(BinaryARPolicy(*theta, model=model), env_policy, y,
                                      mask).sum(-1).exp().reshape(-1)
        ref_lp = ref_policy(y).expand(num, 1, seq_len).reshape(num, seq_len)
        events = reward_events(y, mask).reshape(num, seq_len)
    flat_mask = mask.reshape(num, seq_len)
    logprobs = policy(y).reshape(num, seq_len)
    per_token = credit in ("to-go", "to-date")
    kl_cfg = KLConfig("k1", "reward", coef=beta, reward_to_go=per_token)
    cfg = LossConfig(clip_low=1.0, clip_high=math.inf, aggregation="seq-mean-token-sum",
                     kl=kl_cfg, advantage_estimator="reinforce")
    credited = turn_credit_returns(events, flat_mask, credit)
    if credit == "to-go":  # the trainer's --turn-credit to-go, each reward at its position
        advantages = build_advantages(events.sum(-1), logprobs.detach(), ref_lp, flat_mask,
                                      replace(cfg, turn_credit="to-go"), group_size=1,
                                      token_rewards=events)
    elif per_token:
        returns = credited + compute_rewards_with_kl(
            torch.zeros(num, dtype=DTYPE), logprobs.detach(), ref_lp, flat_mask, kl_cfg)
        advantages = compute_advantages("reinforce", returns, 1, flat_mask)
    else:
        advantages = build_advantages(credited[:, -1] if credit == "last-turn"
                                      else events.sum(-1), logprobs.detach(), ref_lp,
                                      flat_mask, cfg, group_size=1)
    loss, _ = policy_loss_per_token(logprobs, logprobs.detach(), advantages, flat_mask, cfg,
                                    ref_logprobs=ref_lp)
    total = aggregate_loss(loss, flat_mask, cfg.aggregation, num_global_seqs=1)
    grads = -torch.stack(torch.autograd.grad(total, [policy.a, policy.b]), dim=-1)
    mean = weights @ grads
    variance = (weights * (grads - mean).square().sum(-1)).sum().item()
    return mean, variance


def turn_reward_study(theta, ref, env, seq_len: int, model: str = "count",
                      layout: str = "call", beta: float = 1.0) -> dict:
    """Exact bias^2 against grad J (turn_reward_objective_gradient) and per-sample variance of
    each TURN_CREDITS rule (docs/results.md, "Per-turn rewards")."""
    g = turn_reward_objective_gradient(theta, ref, env, seq_len, model, layout, beta)
    rows = []
    for credit in TURN_CREDITS:
        mean, variance = turn_credit_moments(theta, ref, env, seq_len, credit, model, layout,
                                             beta)
        sq_bias = (mean - g).square().sum().item()
        rows.append({"credit": credit, "exact_grad": mean.tolist(), "exact_sq_bias": sq_bias,
                     "variance": variance, "biased": sq_bias > UNBIASED_TOL})
    return {"true_gradient": g.tolist(), "beta": beta, "tool_reward": TOOL_REWARD, "rows": rows}


# ---------------------------------------------------------------- policy losses (--policy-loss)

POLICY_LOSS_NAMES = tuple(POLICY_LOSSES)
# Each loss's own clipping, the study's "clip on" cells, as (clip_low, clip_high): ppo-clip and
# dual-clip DAPO's clip-higher 0.2 / 0.28 (dual-clip's c at LossConfig's default); gspo and
# gspo-token GSPO's 3e-4 / 4e-4 on the sequence ratio; cispo MiniMax's no lower bound (clip_low 1)
# and 0.28 above, on the detached weight; sapo has no clip: the range only sets its
# out-of-range diagnostic, its gate (--sapo-tau-pos/neg) is the same in both cells.
POLICY_LOSS_CLIPS = {"ppo-clip": (0.2, 0.28), "dual-clip": (0.2, 0.28), "gspo": (3e-4, 4e-4),
                     "gspo-token": (3e-4, 4e-4), "cispo": (1.0, 0.28), "sapo": (0.2, 0.28)}
CLIP_OFF = (1.0, math.inf)  # no ratio is clipped (ratios are positive)
STUDY_AGGREGATIONS = ("seq-mean-token-sum", "seq-mean-token-mean")
POLICY_LOSS_KL_CONFIGS = tuple(f"{est}/{pl}" for est in ("k1", "k2", "k3")
                               for pl in ("reward", "loss", "reward+loss"))
POLICY_LOSS_REGIMES = (("on-policy", "none"), ("off-policy", "none"), ("off-policy", "token-is"),
                       ("off-policy", "seq-is"))


def policy_loss_config(name: str, clip: bool, aggregation: str = "seq-mean-token-sum") -> LossConfig:
    """The LossConfig of --policy-loss `name` in the study: its POLICY_LOSS_CLIPS range when
    `clip`, else CLIP_OFF (dual-clip keeps its bound c: it is that loss; sapo's gate cannot be
    turned off); the other loss settings (clip_ratio_c, sapo_tau_pos/neg) at their defaults."""
    if name not in POLICY_LOSS_CLIPS:
        raise ValueError(f"--policy-loss {name!r}: the toy studies {list(POLICY_LOSS_CLIPS)} (or all)")
    low, high = POLICY_LOSS_CLIPS[name] if clip else CLIP_OFF
    cfg = LossConfig(clip_low=low, clip_high=high, aggregation=aggregation, policy_loss=name,
                     advantage_estimator="reinforce")
    cfg.validate()
    return cfg


def stop_mask(y: torch.Tensor, stop_after: int | None) -> torch.Tensor:
    """[..., T] float64 from y [..., T]: 1 at the positions of the sequence, 0 after its end.

    stop_after K: the sequence ends with its K-th token 1 (that token, the stop token, is its
    last; the positions after it are masked), or at T: position t belongs to it iff fewer than K
    ones come before t, c_{t-1} < K. None: every sequence has all T positions."""
    if stop_after is None:
        return torch.ones_like(y)
    return (prefix_features(y, "count") < stop_after).to(DTYPE)


def enumerate_sequences(seq_len: int, stop_after: int | None = None):
    """(y [1, S, T], mask [1, S, T]): every sequence of the law once. With a stop, the binary
    strings whose masked positions hold only zeros (one representative per stopped sequence, so
    that P(y) = exp(sum_t mask_t log p(y_t | y_<t)) sums to 1 over them); else all 2^T."""
    y = all_sequences(seq_len)
    mask = stop_mask(y, stop_after)
    keep = (y * (1 - mask)).sum(-1)[0] == 0
    return y[:, keep], mask[:, keep]


def objective_gradient(theta, ref, seq_len: int, model: str = "count",
                       stop_after: int | None = None, estimator: str = "k1",
                       per_token: bool = False, hold_law: bool = False) -> torch.Tensor:
    """grad_theta [2] of J = sum_y P_theta(y) w(y) sum_t mask_t K_t(y), by autograd through the
    enumerated law (no loss code): K_t the estimator (kl.py's function of the log-probs),
    w = 1/|y| (per_token) or 1, |y| = sum_t mask_t; hold_law: P_theta detached (only the
    path-wise part, E[w sum_t grad K_t]). k1, w = 1: g* = grad KL(A_theta || B) over the
    sequences of the law; k1 per_token: the gradient of the per-token-averaged KL
    E[log(A_theta(y)/B(y)) / |y|]."""
    y, mask = enumerate_sequences(seq_len, stop_after)
    policy, ref_policy = BinaryARPolicy(*theta, model=model), BinaryARPolicy(*ref, model=model)
    logprobs = policy(y)
    with torch.no_grad():
        ref_logprobs = ref_policy(y)
    law = (logprobs * mask).sum(-1).exp()
    if hold_law:
        law = law.detach()
    value = (get_estimator(estimator)(logprobs, ref_logprobs) * mask).sum(-1)
    if per_token:
        value = value / mask.sum(-1)
    grad = torch.autograd.grad((law * value).sum(), [policy.a, policy.b])
    return torch.stack(grad, dim=-1).squeeze(0)


def policy_loss_moments(theta, ref, seq_len: int, kl_cfg: KLConfig, loss: LossConfig, old=None,
                        model: str = "count", stop_after: int | None = None):
    """(E[grad] [2], per-sample variance) of the KL configuration under the policy loss `loss`,
    through the production loss, over every sequence of the law (`enumerate_sequences`), samples
    from A_theta (old None) or A_old, loss_mask = the sequence's positions (`stop_mask`)."""
    y, mask = (x.transpose(0, 1) for x in enumerate_sequences(seq_len, stop_after))  # [S, 1, T]
    policy = BinaryARPolicy(*theta, num_copies=y.shape[0], model=model)
    ref_policy = BinaryARPolicy(*ref, model=model)
    old_policy = BinaryARPolicy(*old, model=model) if old is not None else None
    with torch.no_grad():
        sampler = old_policy if old_policy is not None else BinaryARPolicy(*theta, model=model)
        weights = (sampler(y) * mask).sum(-1).exp().reshape(-1)
    grads = estimator_gradients(policy, ref_policy, y, kl_cfg, old_policy, loss_mask=mask,
                                loss=loss)
    mean = weights @ grads
    variance = (weights * (grads - mean).square().sum(-1)).sum().item()
    return mean, variance


def gradient_of(config: str, aggregation: str) -> str:
    """What the on-policy expected gradient of `config` (estimator/placement) is the gradient of,
    under every policy loss (each loss's gradient at ratio 1 is A grad log pi per token). With w
    the aggregation's weight of a sequence's tokens (1; 1/n for seq-mean-token-mean, n the
    sequence's length): reward+loss gives grad E[w sum_t K_t], the loss alone its path-wise part
    E[w sum_t grad K_t], the reward alone the rest E[w (sum_t K_t) grad log A(y)]. For K1:
    grad log A(y) = sum_t grad K1_t, so the path-wise part is E[w grad log A(y)] = grad E[w]
    (w holds no theta): 0 for w = 1, grad E[1/n] for w = 1/n. For K3 (E[K3_t | y_<t] = KL_t,
    and whether t is in the sequence depends on y_<t only): E[sum_t K3_t] = KL(A || B)."""
    estimator, placement = config.split("/")
    per_token = aggregation == "seq-mean-token-mean"
    known = {("k1", "reward+loss"): "g_tok = E[log(A/B)/n]" if per_token else "g* = KL(A, B)",
             ("k1", "loss"): "E[1/n]" if per_token else "0",
             ("k1", "reward"): "E[(log(A/B) - 1)/n]" if per_token else "g* = KL(A, B)",
             ("k3", "reward+loss"): "E[sum K3 / n]" if per_token else "g* = KL(A, B)"}
    if (estimator, placement) in known:
        return known[estimator, placement]
    total = f"E[sum {estimator.upper()}" + (" / n]" if per_token else "]")
    return {"reward+loss": total, "loss": f"path-wise part of {total}",
            "reward": f"{total} - path-wise part"}[placement]


def policy_loss_study(theta, ref, old, seq_len: int, model: str = "count",
                      losses=POLICY_LOSS_NAMES, aggregation: str = "seq-mean-token-sum",
                      stop_after: int | None = None) -> dict:
    """Exact E[grad], bias^2 and per-sample variance of every (policy loss x POLICY_LOSS_KL_CONFIGS
    x POLICY_LOSS_REGIMES), with clipping off and with the loss's own (POLICY_LOSS_CLIPS), through
    the production loss (`policy_loss_moments`). bias^2 against g* = grad KL(A_theta || B) (the
    sequence-level objective) and against g_tok = grad E[log(A_theta/B)(y)/|y|] (the per-token
    averaged one); `biased` against the aggregation's target (g* for seq-mean-token-sum, g_tok
    for seq-mean-token-mean). On-policy rows also carry the error against the closed form
    (`gradient_of`, computed by `objective_gradient`)."""
    if aggregation not in STUDY_AGGREGATIONS:
        raise ValueError(f"--loss-aggregation {aggregation!r}: the toy studies {list(STUDY_AGGREGATIONS)}")
    per_token = aggregation == "seq-mean-token-mean"
    g_seq = objective_gradient(theta, ref, seq_len, model, stop_after)
    g_tok = objective_gradient(theta, ref, seq_len, model, stop_after, per_token=True)
    target = g_tok if per_token else g_seq
    closed = {}
    for config in POLICY_LOSS_KL_CONFIGS:
        estimator, placement = config.split("/")
        full, path = (objective_gradient(theta, ref, seq_len, model, stop_after, estimator,
                                         per_token, hold) for hold in (False, True))
        closed[config] = {"reward+loss": full, "loss": path, "reward": full - path}[placement]
    rows = []
    for name in losses:
        for clip in ("off", "on"):
            loss = policy_loss_config(name, clip == "on", aggregation)
            for config in POLICY_LOSS_KL_CONFIGS:
                estimator, placement = config.split("/")
                for sampling, correction in POLICY_LOSS_REGIMES:
                    kl = KLConfig(estimator, placement, coef=1.0, off_policy_correction=correction)
                    mean, variance = policy_loss_moments(
                        theta, ref, seq_len, kl, loss, old if sampling == "off-policy" else None,
                        model, stop_after)
                    sq_bias = (mean - target).square().sum().item()
                    row = {"loss": name, "clip": clip, "clip_low": loss.clip_low,
                           "clip_high": loss.clip_high, "config": config, "estimator": estimator,
                           "placement": placement, "sampling": sampling, "correction": correction,
                           "exact_grad": mean.tolist(), "exact_sq_bias": sq_bias,
                           "sq_bias_sequence_kl": (mean - g_seq).square().sum().item(),
                           "sq_bias_per_token_kl": (mean - g_tok).square().sum().item(),
                           "variance": variance, "biased": sq_bias > UNBIASED_TOL}
                    if sampling == "on-policy":
                        row["gradient_of"] = gradient_of(config, aggregation)
                        row["closed_form_abs_err"] = (mean - closed[config]).abs().max().item()
                    rows.append(row)
    y, mask = enumerate_sequences(seq_len, stop_after)
    with torch.no_grad():
        lp = {label: BinaryARPolicy(*params, model=model)(y) * mask
              for label, params in (("theta", theta), ("ref", ref), ("old", old))}
        law = {label: x.sum(-1).exp()[0] for label, x in lp.items()}
        log_ratio = (lp["theta"] - lp["ref"]).sum(-1)[0]
        length = mask.sum(-1)[0]
        token_ratio = (lp["theta"] - lp["old"]).exp()[mask > 0]
    return {"losses": list(losses), "aggregation": aggregation, "stop_after": stop_after,
            "seq_len": seq_len, "kl": (law["theta"] * log_ratio).sum().item(),
            "kl_per_token": (law["theta"] * log_ratio / length).sum().item(),
            "true_gradient": g_seq.tolist(), "per_token_gradient": g_tok.tolist(),
            "target": "per-token" if per_token else "sequence",
            "mean_length": {label: (law[label] * length).sum().item() for label in ("theta", "old")},
            "token_ratio_range": [token_ratio.min().item(), token_ratio.max().item()],
            "clips": {name: list(POLICY_LOSS_CLIPS[name]) for name in losses},
            "clip_ratio_c": LossConfig.clip_ratio_c, "rows": rows}


def run_study(setup: ToySetup) -> dict:
    """Exact (enumeration) and Monte-Carlo bias and variance of every run in setup.runs."""
    start, start_cpu = time.perf_counter(), time.process_time()
    model, t = setup.model, setup.seq_len
    g_star = true_gradient(setup.theta, setup.ref, t, model)
    g_enum = enumerated_kl_gradient(setup.theta, setup.ref, t, model)
    g_closed = closed_form_kl_gradient(setup.theta, setup.ref, t, model)
    kl_value = closed_form_kl(setup.theta, setup.ref, t, model)
    kl_enum = enumerated_kl(setup.theta, setup.ref, t, model)
    closed = closed_form_gradients(setup.theta, setup.ref, t, model)

    generator = torch.Generator().manual_seed(setup.seed)
    k, n = setup.num_trials, setup.num_samples
    do_mc = k > 0 and n > 0
    samples, ref_policy, old_policy, chunks, mc_policies = {}, None, None, [], {}
    if do_mc:
        samples = {False: BinaryARPolicy(*setup.theta, num_copies=k, model=model).sample(n, t, generator),
                   True: BinaryARPolicy(*setup.old, num_copies=k, model=model).sample(n, t, generator)}
        ref_policy = BinaryARPolicy(*setup.ref, model=model)
        old_policy = BinaryARPolicy(*setup.old, model=model)
        # Trials run in chunks: the same numbers, but [chunk * N, T] tensors stay cache-sized.
        chunks = [(lo, min(lo + TRIAL_CHUNK, k)) for lo in range(0, k, TRIAL_CHUNK)]
        mc_policies = {size: BinaryARPolicy(*setup.theta, num_copies=size, model=model)
                       for size in {hi - lo for lo, hi in chunks}}

    rows = []
    for run in setup.runs:
        old = setup.old if run.off_policy else None
        exact, variance = exact_gradient_moments(setup.theta, setup.ref, t, run.kl, old, model)
        _, variance_b = exact_gradient_moments(setup.theta, setup.ref, t, run.kl, old, model, True)
        exact_sq_bias = (exact - g_star).square().sum().item()
        row = {
            "config": run.name, "estimator": run.kl.estimator, "placement": run.kl.placement,
            "sampling": "off-policy" if run.off_policy else "on-policy",
            "correction": run.kl.off_policy_correction,
            "exact_grad": exact.tolist(), "exact_sq_bias": exact_sq_bias,
            "variance": variance, "variance_mean_baseline": variance_b,
            "biased": exact_sq_bias > UNBIASED_TOL,
        }
        if do_mc:
            grads = torch.cat([
                estimator_gradients(mc_policies[hi - lo], ref_policy, samples[run.off_policy][lo:hi],
                                    run.kl, old_policy if run.off_policy else None)
                for lo, hi in chunks])
            mc_mean = grads.mean(0)
            row["mc_mean_grad"] = mc_mean.tolist()
            row["mc_sq_bias"] = (mc_mean - g_star).square().sum().item()
            row["mc_variance"] = n * grads.var(0).sum().item() if k > 1 else float("nan")
        if not run.off_policy and _run_key(run) in closed:
            row["closed_form_abs_err"] = (exact - closed[_run_key(run)]).abs().max().item()
        rows.append(row)
    settings = [(setup.theta, setup.ref)] + [s for s in setup.variance_settings
                                             if tuple(map(tuple, s)) != (setup.theta, setup.ref)]
    sweep = variance_sweep(settings, t, model, setup.runs)
    studies = ({} if setup.rollout is None else
               {"three_distribution": three_distribution_study(setup.theta, setup.ref, setup.old,
                                                               setup.rollout, t, model,
                                                               setup.is_truncation)})
    if setup.versions is not None:
        older, newer = setup.versions
        studies["versions"] = versions_study(setup.theta, setup.ref, setup.old, older, newer, t,
                                             model, setup.switch, setup.is_truncation)
    if setup.env_tokens is not None:
        env = setup.env if setup.env is not None else DEFAULT_ENV[model]
        studies["trajectory"] = trajectory_study(setup.theta, setup.ref, setup.old, env, t, model,
                                                 setup.env_tokens)
        studies["trajectory"]["turn_rewards"] = turn_reward_study(setup.theta, setup.ref, env, t,
                                                                  model, setup.env_tokens)
    if setup.policy_losses:
        studies["policy_loss"] = policy_loss_study(setup.theta, setup.ref, setup.old, t, model,
                                                   setup.policy_losses, setup.loss_aggregation,
                                                   setup.stop_after)
    return {
        "setup": {"model": model, "seq_len": t, "theta": list(setup.theta), "ref": list(setup.ref),
                  "old": list(setup.old), "num_trials": k, "num_samples": n, "seed": setup.seed,
                  "beta": 1.0, "advantage": "reinforce (no baseline)",
                  "aggregation": "seq-mean-token-sum", "dtype": "float64"},
        "kl": kl_value,
        "kl_enum_abs_err": abs(kl_enum - kl_value),
        "true_gradient": g_star.tolist(),
        "true_gradient_enum_abs_err": (g_enum - g_star).abs().max().item(),
        "true_gradient_closed_form_abs_err": (g_closed - g_star).abs().max().item(),
        "rows": rows,
        "variance_sweep": sweep,
        **studies,
        "runtime_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - start_cpu,
    }


def _fmt_vec(v) -> str:
    return "[" + ", ".join(f"{x:+.4f}" for x in v) + "]"


def _variance_reading(result: dict) -> list:
    """Sentences stating what the variance comparison shows, computed from the numbers."""
    needed = {"exact/reward+loss later", "k1/reward"}
    sweep = [s for s in result.get("variance_sweep") or [] if needed <= s["rows"].keys()]
    if not sweep:
        return []
    ratio = [s["rows"]["exact/reward+loss later"]["variance"] / s["rows"]["k1/reward"]["variance"]
             for s in sweep]
    ratio_b = [s["rows"]["exact/reward+loss later"]["variance_mean_baseline"]
               / s["rows"]["k1/reward"]["variance_mean_baseline"] for s in sweep]
    here = ratio[0]
    order = sorted(range(len(sweep)), key=lambda i: sweep[i]["kl"])
    lo, hi = order[0], order[-1]
    returns = ("exact/reward+loss", "exact/reward+loss to-go", "exact/reward+loss later")
    later_best = sum(min(returns, key=lambda r: s["rows"][r]["variance"]) == returns[2]
                     for s in sweep if set(returns) <= s["rows"].keys())
    return [
        f"What it means: `exact` in reward+loss (path-wise sum_t grad KL_t plus the score term with "
        f"the later positions' KL as return) gives the true gradient at float rounding, with "
        f"{here:.2f}x the per-sample variance of K1 in the reward at this setting: "
        f"{max(here, 1 / here):.1f}x {'fewer' if here < 1 else 'more'} samples for the same "
        f"gradient noise. It removes the sampling noise of each position's KL (an average over the "
        f"token instead of one draw), not that of the score function, which multiplies the "
        f"KL-to-go: across the settings of the table above the ratio is "
        f"{min(ratio):.2f}-{max(ratio):.2f}x, {ratio[lo]:.2f}x at the smallest KL "
        f"({sweep[lo]['kl']:.2f} nats) and {ratio[hi]:.2f}x at the largest ({sweep[hi]['kl']:.2f}); "
        f"{min(ratio_b):.2f}-{max(ratio_b):.2f}x with the mean baseline. Counting only later "
        f"positions in the return was the lowest-variance of the three exact returns in "
        f"{later_best} of {len(sweep)} settings: the term s_t KL_t it drops has mean zero but "
        f"can be negatively correlated with the rest.",
    ]


def _cell(row: dict) -> str:
    """bias^2 / variance, bias^2 in bold when below UNBIASED_TOL."""
    bias = f"{row['exact_sq_bias']:.2e}"
    return f"{'**' + bias + '**' if not row['biased'] else bias} / {row['variance']:.3g}"


def three_distribution_markdown(result: dict) -> list:
    """Lines of the three-distribution study's tables (run_study with a rollout), then what they show."""
    three = result["three_distribution"]
    setup = result["setup"]
    rows = three["rows"]
    sw = three["sequence_weights"]
    c = three["is_truncation"]
    kl_rows = {(r["config"], r["correction"], r["proposal"] or "behaviour"): r
               for r in rows if r["table"] == "kl"}
    names = list(dict.fromkeys(r["config"] for r in rows if r["table"] == "kl"))
    columns = [f"{corr}" if corr == "none" else f"{corr} / {PROPOSAL_NAMES[prop]}"
               for corr, prop in KL_COLUMNS]
    lines = [
        "", f"Three distributions: samples y ~ mu = {three['rollout']} (the engine), the PPO ratio's "
        f"denominator pi_old = {three['old']} (the trainer's recompute), A_theta = {setup['theta']}; "
        "the same g* as above. Columns: the KL's off-policy correction and what its importance "
        "weights divide by (--kl-is-proposal: behaviour = pi_old, rollout = mu). Cells: "
        "bias^2 = |E_mu[grad] - g*|^2 / per-sample variance under mu, exact (enumeration of all "
        f"2^T sequences, float64), no baseline; bias^2 in bold: below {UNBIASED_TOL:g} (unbiased). "
        f"Sequence level: KL(mu || pi_old) = {sw['kl_mu_old']:.4f}, KL(A_theta || mu) = "
        f"{sw['kl_theta_mu']:.4f} nats; under mu the weight A_theta/pi_old has mean "
        f"{sw['behaviour']['mean']:.4f} and second moment {sw['behaviour']['second_moment']:.3g}, "
        f"A_theta/mu mean {sw['rollout']['mean']:.4f} and second moment "
        f"{sw['rollout']['second_moment']:.3g}; token weights pi_old/mu within "
        f"[{sw['token_weight_range'][0]:.3f}, {sw['token_weight_range'][1]:.3f}].", "",
        "| config | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(_cell(kl_rows[name, corr, prop])
                                                 for corr, prop in KL_COLUMNS) + " |")
    trunc = {(r["config"], r["proposal"]): r for r in rows if r["table"] == "truncation"}
    if trunc:
        lines += ["", f"seq-is with truncated weights min(w, {c:g}) (--is-truncation; the trainer's "
                  "--kl-is-truncation): bias^2 vs "
                  "g*, per-sample variance, and the shift^2 = |E[grad, truncated] - E[grad, "
                  "untruncated]|^2 the truncation causes:", "",
                  "| config | " + " | ".join(f"/ {PROPOSAL_NAMES[p]}: bias^2 | variance | shift^2"
                                             for p in IS_PROPOSALS) + " |",
                  "|---|" + "---|---|---|" * len(IS_PROPOSALS)]
        for name in dict.fromkeys(n for n, _ in trunc):
            cells = [f"{trunc[name, p]['exact_sq_bias']:.3e} | {trunc[name, p]['variance']:.3g} | "
                     f"{trunc[name, p]['truncation_shift_sq']:.3e}" for p in IS_PROPOSALS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    pg = {(r["config"], r["pg_correction"]): r for r in rows if r["table"] == "pg"}
    if pg:
        labels = list(dict.fromkeys(label for _, label in pg))
        lines += ["", "KL inside the advantage (correction none) under the policy-gradient rollout "
                  "correction (--rollout-correction: detached weights pi_old/mu on the surrogate, "
                  "float32 as in the trainer): bias^2 / variance:", "",
                  "| config | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        for name in dict.fromkeys(n for n, _ in pg):
            lines.append(f"| {name} | " + " | ".join(_cell(pg[name, label]) for label in labels) + " |")
    lines += [""] + _three_distribution_reading(three)
    return lines


def _three_distribution_reading(three: dict) -> list:
    """Sentences stating which columns are unbiased here, computed from the numbers."""
    kl_rows = [r for r in three["rows"] if r["table"] == "kl"]
    unbiased = [r for r in kl_rows if not r["biased"]]
    found = ", ".join(f"{r['config']} ({r['correction']} / {PROPOSAL_NAMES[r['proposal']]})"
                      for r in unbiased) or "none"
    same = [r for r in kl_rows if r["correction"] == "seq-is" and r["proposal"] == "behaviour"
            and any(u["config"] == r["config"] for u in unbiased)]
    lines = [f"What it shows: unbiased here (bias^2 <= {UNBIASED_TOL:g}): {found}."]
    if same:
        lo = min(r["exact_sq_bias"] for r in same)
        hi = max(r["exact_sq_bias"] for r in same)
        lines[0] += (f" The same configurations with seq-is weights against pi_old: bias^2 "
                     f"{lo:.3g}-{hi:.3g}.")
    pg = [r for r in three["rows"] if r["table"] == "pg" and r["pg_correction"] != "none"]
    if pg:
        lines[0] += (f" No policy-gradient rollout correction makes a KL inside the advantage "
                     f"unbiased: bias^2 {min(r['exact_sq_bias'] for r in pg):.3g}-"
                     f"{max(r['exact_sq_bias'] for r in pg):.3g}."
                     if all(r["biased"] for r in pg) else
                     " Some policy-gradient rollout corrections left the KL inside the advantage "
                     "unbiased here.")
    return lines


def _switch_words(switch: str, seq_len: int) -> str:
    if switch == "random":
        return f"the switch point S uniform on 0..{seq_len}, independent of the tokens"
    if switch.startswith("ones:"):
        return f"the switch right after the {switch.partition(':')[2]}-th token 1 (none before it)"
    return f"the switch after token S = {switch}"


def versions_markdown(result: dict) -> list:
    """Lines of the versions study's tables (run_study with versions), then what they show."""
    study = result["versions"]
    setup = result["setup"]
    rows = study["rows"]
    wt = study["weights"]
    kl_rows = {(r["config"], r["correction"], r["proposal"], r["record"]): r
               for r in rows if r["table"] == "kl"}
    names = list(dict.fromkeys(r["config"] for r in rows if r["table"] == "kl"))
    columns = [VERSION_COLUMN_NAMES[c] for c in VERSION_COLUMNS]
    lines = [
        "", f"Mixed versions: each sample's tokens before the switch from the older version "
        f"A = {study['older']}, after it from the newer B = {study['newer']}, "
        f"{_switch_words(study['switch'], setup['seq_len'])}; the PPO ratio's denominator "
        f"pi_old = {study['old']} (the trainer's recompute), A_theta = {setup['theta']}; the "
        "same g* as above. Columns: the KL's off-policy correction, what its weights divide by "
        "(pi_old; mu_t = each token's own version, the rollout_logprobs the engine records; "
        "mu_B = the newer version at every token, one mu for the whole sequence). Cells: bias^2 "
        "= |E_q[grad] - g*|^2 / per-sample variance under the mixed sampler q, exact "
        "(enumeration of every sequence and switch outcome, float64), no baseline; bias^2 in "
        f"bold: below {UNBIASED_TOL:g}. KL(q || pi_old) = {wt['kl_q_old']:.4f} nats per "
        f"sequence; under q the sequence weight A_theta/prod_t mu_t has mean "
        f"{wt['own']['mean']:.4f} and second moment {wt['own']['second_moment']:.3g}, "
        f"A_theta/prod_t mu_B mean {wt['last']['mean']:.4f} and second moment "
        f"{wt['last']['second_moment']:.3g}; mean |log pi_old - rollout_logprob| per token "
        f"{wt['own']['log_ratio_abs']:.4f} with each token's own record, "
        f"{wt['last']['log_ratio_abs']:.4f} with mu_B's.", "",
        "| config | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(_cell(kl_rows[(name, *c)])
                                                 for c in VERSION_COLUMNS) + " |")
    pg = {(r["config"], r["pg_correction"]): r for r in rows if r["table"] == "pg"}
    if pg:
        labels = list(dict.fromkeys(label for _, label in pg))
        lines += ["", "KL inside the advantage (correction none) under the policy-gradient rollout "
                  "correction on each token's own record (--rollout-correction: weights "
                  "pi_old/mu_t, float32 as in the trainer): bias^2 / variance:", "",
                  "| config | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        for name in dict.fromkeys(n for n, _ in pg):
            lines.append(f"| {name} | " + " | ".join(_cell(pg[name, label]) for label in labels) + " |")
    by_switch = study["by_switch"]
    if by_switch:
        lines += ["", f"By switch point S (fixed; S = 0: every token from B, S = T: every token "
                  f"from A, the single-mu study with mu = B or A), {SWITCH_SWEEP_CONFIG} under "
                  "seq-is against each token's own record and against mu_B; the sequence "
                  "weight's second moment under q (own record: 1 + chi^2(A_theta || q)) and the "
                  "one-mu weight's mean (1 when unbiased); mean |log pi_old - rollout_logprob| "
                  "per token with either record:", "",
                  "| S | seq-is / mu_t | seq-is / mu_B | E_q[W^2], mu_t | E_q[W], mu_B | "
                  "abs log ratio, mu_t / mu_B |", "|---|---|---|---|---|---|"]
        for entry in by_switch:
            w = entry["weights"]
            lines.append(f"| {entry['switch']} | {_cell(entry['own'])} | {_cell(entry['last'])} | "
                         f"{w['own']['second_moment']:.3g} | {w['last']['mean']:.4f} | "
                         f"{w['own']['log_ratio_abs']:.4f} / {w['last']['log_ratio_abs']:.4f} |")
    lines += [""] + _versions_reading(study)
    return lines


def _versions_reading(study: dict) -> list:
    """Sentences stating which columns are unbiased here, computed from the numbers."""
    kl_rows = [r for r in study["rows"] if r["table"] == "kl"]
    unbiased = [r for r in kl_rows if not r["biased"]]
    found = ", ".join(f"{r['config']} ({VERSION_COLUMN_NAMES[r['correction'], r['proposal'], r['record']]})"
                      for r in unbiased) or "none"
    lines = [f"What it shows: unbiased here (bias^2 <= {UNBIASED_TOL:g}): {found}."]
    one_mu = [r for r in kl_rows if r["record"] == "last"
              and any(u["config"] == r["config"] for u in unbiased)]
    if one_mu:
        lines[0] += (f" The same configurations with one mu (mu_B) for the whole sequence: bias^2 "
                     f"{min(r['exact_sq_bias'] for r in one_mu):.3g}-"
                     f"{max(r['exact_sq_bias'] for r in one_mu):.3g}.")
    token = [r for r in kl_rows if r["correction"] == "token-is"]
    if token and all(r["biased"] for r in token):
        lines[0] += (f" Token-level weights against each token's own mu leave every row biased "
                     f"(bias^2 {min(r['exact_sq_bias'] for r in token):.3g}-"
                     f"{max(r['exact_sq_bias'] for r in token):.3g}).")
    pg = [r for r in study["rows"] if r["table"] == "pg" and r["pg_correction"] != "none"]
    if pg:
        lines[0] += (f" No policy-gradient rollout correction makes a KL inside the advantage "
                     f"unbiased: bias^2 {min(r['exact_sq_bias'] for r in pg):.3g}-"
                     f"{max(r['exact_sq_bias'] for r in pg):.3g}."
                     if all(r["biased"] for r in pg) else
                     " Some policy-gradient rollout corrections left the KL inside the advantage "
                     "unbiased here.")
    return lines


MASK_NAMES = {"masked": "masked", "charged": "charged", "env-in-weights": "env in weights"}
LAYOUT_NAMES = {"call": "after each policy token 1 (a tool call) one environment token (its "
                        "output), then the policy again",
                "alternate": "an environment token after every policy token"}


def trajectory_markdown(result: dict) -> list:
    """Lines of the trajectory study's table (run_study with env_tokens), then what it shows."""
    traj = result["trajectory"]
    setup = result["setup"]
    cells = {(r["config"], r["sampling"], r["correction"], r["mask"]): r for r in traj["rows"]}
    names = list(dict.fromkeys(r["config"] for r in traj["rows"]))
    single = {}
    for r in traj["single_turn"]:
        if not r["biased"]:
            single.setdefault(r["config"], []).append(
                "on-policy" if r["sampling"] == "on-policy" else f"off {r['correction']}")
    columns = [f"{'on' if s == 'on-policy' else 'off ' + c}: {MASK_NAMES[m]}"
               for s, c, m in TRAJECTORY_COLUMNS]
    ntok = traj["mean_policy_tokens"]
    lines = [
        "", f"Trajectories (--env-tokens {traj['layout']}): T = {traj['seq_len']} tokens, "
        f"{LAYOUT_NAMES[traj['layout']]}; environment kernel E(x_t = 1 | h_t) = sigmoid(e0 + e1 "
        f"c_{{t-1}}), (e0, e1) = {traj['env']}, c_{{t-1}} from every earlier token; the policy "
        f"conditions on the environment's tokens as on its own. Policy tokens per trajectory: "
        f"{ntok['theta']:.2f} under P_theta, {ntok['old']:.2f} under P_old (A_theta = "
        f"{setup['theta']}, B = {setup['ref']}, A_old = {setup['old']} at the policy's tokens, the "
        f"same kernel at the environment's). KL(P_theta || P_ref) = {traj['kl']:.6f} nats "
        f"(enumeration of all 2^T trajectories with the environment's factors in both laws; "
        f"E_theta[sum over policy tokens of KL_t] differs by {traj['kl_per_position_abs_err']:.1e}). "
        f"g* = grad KL(P_theta || P_ref) = {_fmt_vec(traj['true_gradient'])} (autograd of the "
        f"enumerated KL; the score-function sum E[log(P_theta/P_ref) sum_policy s_t] without "
        f"autograd differs by {traj['true_gradient_score_abs_err']:.1e}). For comparison, the "
        f"policy writing the environment's tokens too: KL(A_theta || B) over all T tokens = "
        f"{traj['all_tokens_kl']:.4f}, gradient {_fmt_vec(traj['all_tokens_gradient'])}.", "",
        "Cells: bias^2 = |E[grad] - g*|^2 / per-sample variance, exact, through the production "
        "loss (REINFORCE, beta 1, no baseline); bias^2 in bold: below "
        f"{UNBIASED_TOL:g} (unbiased). Columns: sampling (on: P_theta; off: P_old), the KL's "
        "off-policy correction, and the loss_mask: masked = the policy's tokens (the trainer's); "
        "charged = every token (the environment's scored as if the policy had sampled them); env "
        "in weights = masked, the seq-is weights also multiplying the environment tokens' "
        "pi_theta/pi_old. Last column: where the single-turn study (no environment tokens, same "
        "T) finds the row unbiased.", "",
        "| config | " + " | ".join(columns) + " | unbiased single-turn |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(_cell(cells[(name, *col)])
                                                 for col in TRAJECTORY_COLUMNS)
                     + f" | {', '.join(single.get(name, [])) or '-'} |")
    lines += [""] + _trajectory_reading(traj)
    if "turn_rewards" in traj:
        lines += turn_reward_markdown(traj["turn_rewards"])
    return lines


def turn_reward_markdown(study: dict) -> list:
    """Lines of the per-turn reward table (turn_reward_study)."""
    lines = [
        "", f"Per-turn rewards: R_j = {study['tool_reward']:g} x the environment's answer to "
        "turn j's call, plus the last token where it is the policy's (the final answer); "
        f"J = E_theta[sum_j R_j] - {study['beta']:g} KL(P_theta || P_ref), grad J = "
        f"{_fmt_vec(study['true_gradient'])} (autograd of the enumeration). On-policy, K1 in "
        "the reward over the policy's tokens, REINFORCE, through the production code; each "
        "policy token credited with: sum = sum_j R_j, to-go = the rewards of its turn and later "
        "(the KL to go too), last-turn = the last turn's alone, to-date = its turn's and "
        "earlier.", "",
        "| credit | bias^2 / variance |", "|---|---|"]
    lines += [f"| {r['credit']} | {_cell(r)} |" for r in study["rows"]]
    return lines


def _trajectory_reading(traj: dict) -> list:
    """Sentences stating what the trajectory table shows, computed from the numbers."""
    def regime(r):
        return r["config"], r["sampling"], r["correction"]

    masked = {regime(r) for r in traj["rows"] if r["mask"] == "masked" and not r["biased"]}
    single = {regime(r) for r in traj["single_turn"] if not r["biased"]}
    charged = [r for r in traj["rows"] if r["mask"] == "charged"]
    in_weights = [r for r in traj["rows"] if r["mask"] == "env-in-weights"
                  and (r["config"], "off-policy", "seq-is") in masked]
    regimes = sorted({"on-policy" if r[1] == "on-policy" else f"off-policy under {r[2]}"
                      for r in masked}, key=lambda label: label != "on-policy")
    text = ("What it shows: with the environment's tokens masked, a configuration is unbiased "
            "for the trajectory KL in exactly the regimes where the single-turn study finds it "
            f"unbiased ({len(masked)} configuration-regime pairs: "
            f"{', '.join(sorted({r[0] for r in masked}))}; {' and '.join(regimes)})."
            if masked == single else
            "What it shows: the masked configurations' verdicts differ from the single-turn "
            f"study's: unbiased here only {sorted(masked - single)}, there only "
            f"{sorted(single - masked)}.")
    unbiased_charged = [r for r in charged if not r["biased"]]

    def span(rows, key="exact_sq_bias"):
        return f"{min(r[key] for r in rows):.3g}-{max(r[key] for r in rows):.3g}"

    text += (f" Charging them (loss_mask = every token) biases every configuration in every regime: "
             f"bias^2 {span(charged)}"
             if not unbiased_charged else
             f" Charging them leaves {len(unbiased_charged)} of {len(charged)} cells unbiased here "
             f"(bias^2 {span(charged)})")
    all_tokens = sum(r["sq_bias_vs_all_tokens"] <= UNBIASED_TOL for r in charged)
    text += (f"; against the gradient of KL(A_theta || B) over all T tokens, the objective they "
             f"estimate as if the policy had sampled the environment's tokens, they are unbiased "
             f"in {all_tokens} of {len(charged)} cells (bias^2 "
             f"{span(charged, 'sq_bias_vs_all_tokens')}).")
    if in_weights:
        biased = all(r["biased"] for r in in_weights)
        text += (f" The environment tokens' ratios in the seq-is weights make the configurations "
                 f"that masked seq-is keeps unbiased {'biased' if biased else 'not all biased'}: "
                 f"bias^2 {span(in_weights)}.")
    return [text]


def _policy_loss_cells(rows, losses, key) -> list:
    """The _cell of each loss for the rows matching key (config, clip, sampling, correction)."""
    return [_cell(rows[(loss, *key)]) for loss in losses]


def policy_loss_markdown(result: dict) -> list:
    """Lines of the policy-loss study's tables (run_study with policy_losses), then what they show."""
    study = result["policy_loss"]
    setup = result["setup"]
    losses = study["losses"]
    rows = {(r["loss"], r["config"], r["clip"], r["sampling"], r["correction"]): r
            for r in study["rows"]}
    per_token = study["target"] == "per-token"
    target = ("g_tok = grad E[log(A_theta/B)(y) / |y|] (the per-token-averaged KL)" if per_token
              else "g* = grad KL(A_theta || B) (the sequence-level KL)")
    length = (f"each sequence ends at the token 1 that brings its count of ones to "
              f"{study['stop_after']} (the stop token; the positions after it are masked out of "
              f"the loss) or at T = {study['seq_len']}: mean "
              f"length {study['mean_length']['theta']:.3f} under A_theta, "
              f"{study['mean_length']['old']:.3f} under A_old"
              if study["stop_after"] is not None else f"fixed length T = {study['seq_len']}")
    clips = ", ".join(f"{name} {lo:g}/{hi:g}" for name, (lo, hi) in study["clips"].items())
    header = "| config | " + " | ".join(losses) + " |"
    rule = "|---|" + "---|" * len(losses)
    lines = [
        "", f"Policy losses (--policy-loss): every (policy loss x KL estimator x placement), through "
        f"the production loss (REINFORCE, task reward 0, beta 1, no baseline), aggregation "
        f"{study['aggregation']}; {length}. Model and parameters as above (A_theta = "
        f"{setup['theta']}, B = {setup['ref']}, A_old = {setup['old']}). KL(A_theta || B) = "
        f"{study['kl']:.6f} nats, E[log(A_theta/B)(y)/|y|] = {study['kl_per_token']:.6f} nats per "
        f"token; g* = {_fmt_vec(study['true_gradient'])}, g_tok = "
        f"{_fmt_vec(study['per_token_gradient'])} (autograd through the enumerated law). Cells: "
        f"bias^2 = |E[grad] - target|^2 / per-sample variance, exact (every sequence enumerated); "
        f"target: {target}; bias^2 in bold: below {UNBIASED_TOL:g}. Clipping off: clip_low 1, "
        f"clip_high inf (dual-clip keeps c = {study['clip_ratio_c']:g}; sapo's gate has no off); "
        f"on: (clip_low/clip_high) {clips}.", "",
        "On-policy, clipping off; 'gradient of': the objective whose gradient every loss's "
        "E[grad] is (n = the sequence's length, KL(A, B) = KL(A_theta || B); the reward "
        "placement's score term, the loss placement's path-wise term; each cell is checked "
        "against it, `closed_form_abs_err` in --json):", "",
        "| config | gradient of | " + " | ".join(losses) + " |", "|---|---|" + "---|" * len(losses),
    ]
    for config in POLICY_LOSS_KL_CONFIGS:
        first = rows[(losses[0], config, "off", "on-policy", "none")]
        lines.append(f"| {config} | {first['gradient_of']} | "
                     + " | ".join(_policy_loss_cells(rows, losses, (config, "off", "on-policy", "none")))
                     + " |")
    for clip, title in (("off", "clipping off"), ("on", "each loss's clipping on")):
        lines += ["", f"Off-policy (samples from A_old), {title}:", "",
                  header.replace("| config |", "| config | correction |"),
                  rule.replace("|---|", "|---|---|", 1)]
        for config in POLICY_LOSS_KL_CONFIGS:
            for _, correction in POLICY_LOSS_REGIMES[1:]:
                lines.append(f"| {config} | {correction} | " + " | ".join(
                    _policy_loss_cells(rows, losses, (config, clip, "off-policy", correction)))
                    + " |")
    lines += [""] + _policy_loss_reading(study)
    return lines


def _policy_loss_reading(study: dict) -> list:
    """Sentences stating what the policy-loss tables show, computed from the numbers."""
    losses = study["losses"]
    rows = study["rows"]
    grads = {(r["loss"], r["config"], r["clip"], r["sampling"], r["correction"]):
             torch.tensor(r["exact_grad"], dtype=DTYPE) for r in rows}

    def spread(keys) -> float:
        """Largest |E[grad] difference| between the losses, over the given (config, clip,
        sampling, correction) keys."""
        out = 0.0
        for key in keys:
            vals = [grads[(loss, *key)] for loss in losses]
            out = max(out, max((v - vals[0]).abs().max().item() for v in vals))
        return out

    on = [r for r in rows if r["sampling"] == "on-policy"]
    on_keys = [(c, clip, "on-policy", "none") for c in POLICY_LOSS_KL_CONFIGS for clip in ("off", "on")]
    clip_shift = max((grads[(r["loss"], r["config"], "on", "on-policy", "none")]
                      - grads[(r["loss"], r["config"], "off", "on-policy", "none")]).abs().max().item()
                     for r in on)
    text = (f"What it shows: on-policy every loss gives the same expected gradient (largest "
            f"difference between losses {spread(on_keys):.1e}), each equal to its closed form "
            f"within {max(r['closed_form_abs_err'] for r in on):.1e}, with clipping on as off "
            f"(largest change {clip_shift:.1e}): at ratio 1 no clip binds and every loss's "
            f"gradient is A grad log pi per token.")
    outside = [(c, clip, "off-policy", corr) for c in POLICY_LOSS_KL_CONFIGS
               for clip in ("off", "on") for _, corr in POLICY_LOSS_REGIMES[1:]
               if corr == "seq-is" or c.endswith("/loss")]
    text += (f" Off-policy the loss matters only where the KL is inside the advantage (reward, "
             f"reward+loss under none / token-is): with the loss placement or under seq-is the "
             f"advantage is 0 and every loss gives the same gradient (largest difference "
             f"{spread(outside):.1e}).")
    unbiased = sorted({(r["config"], r["correction"]) for r in rows
                       if r["sampling"] == "off-policy" and not r["biased"]})
    everywhere = [k for k in unbiased
                  if all(not r["biased"] for r in rows if (r["config"], r["correction"]) == k
                         and r["sampling"] == "off-policy")]
    text += (" Unbiased off-policy: " + (", ".join(f"{c} {corr}" for c, corr in unbiased) or "none")
             + (" (under every loss, clipped or not)." if unbiased and everywhere == unbiased
                else "."))
    k1 = {(r["loss"], r["clip"]): r for r in rows if r["config"] == "k1/reward"
          and r["sampling"] == "off-policy" and r["correction"] == "none"}
    if k1:
        text += (" K1 in the reward uncorrected off-policy, bias^2 by loss (clipping off / on): "
                 + ", ".join(f"{loss} {k1[loss, 'off']['exact_sq_bias']:.3g} / "
                             f"{k1[loss, 'on']['exact_sq_bias']:.3g}" for loss in losses) + ".")
    lo, hi = study["token_ratio_range"]
    if "dual-clip" in losses and "ppo-clip" in losses:
        same = max((grads[("dual-clip", *k)] - grads[("ppo-clip", *k)]).abs().max().item()
                   for k in {key[1:] for key in grads})
        text += (f" Token ratios A_theta/A_old lie within [{lo:.3f}, {hi:.3f}]"
                 + (f", below dual-clip's c = {study['clip_ratio_c']:g}: dual-clip equals ppo-clip in "
                    f"every cell (largest difference {same:.1e})." if hi < study["clip_ratio_c"]
                    else "."))
    return [text]


def markdown_table(result: dict) -> str:
    """Table-1-like summary of run_study's result, then the variance comparison."""
    setup = result["setup"]
    mc = setup["num_trials"] > 0 and setup["num_samples"] > 0
    model = ("c_{t-1} = number of ones so far (paper eq. 17-18)" if setup["model"] == "count"
             else "c_{t-1} = sign of the previous token")
    lines = [
        f"Toy study, model `{setup['model']}`: p_t = sigmoid(a + b c_{{t-1}}), {model}. "
        f"T={setup['seq_len']}, theta={setup['theta']}, ref={setup['ref']}, old={setup['old']}; "
        f"beta 1, REINFORCE, float64.",
        "",
        f"KL(A_theta || B) = {result['kl']:.6f} nats (closed form; enumeration differs by "
        f"{result['kl_enum_abs_err']:.1e}). True gradient g* = {_fmt_vec(result['true_gradient'])} "
        f"(closed form (C3) and enumeration differ by {result['true_gradient_closed_form_abs_err']:.1e} "
        f"and {result['true_gradient_enum_abs_err']:.1e}).",
        "",
        "E[grad], bias^2 = |E[grad] - g*|^2 and the per-sample variance (trace of the covariance "
        "of one sequence's gradient; a batch of N has 1/N of it) are exact, by enumeration of all "
        "2^T sequences; without a baseline, and with the mean KL penalty as baseline (the "
        "large-group limit of RLOO; same E[grad])"
        + (f". MC: {setup['num_trials']} trials x {setup['num_samples']} samples, its per-sample "
           f"variance = {setup['num_samples']} x the variance across trials (no baseline)." if mc else "."),
        "",
        "| config | sampling | E[grad] (exact) | bias^2 (exact) | variance/sample | "
        "variance/sample, mean baseline |" + (" MC bias^2 | MC variance/sample |" if mc else "") + " biased |",
        "|---|---|---|---|---|---|" + ("---|---|" if mc else "") + "---|",
    ]
    for row in result["rows"]:
        line = (f"| {row['config']} | {row['sampling']} | {_fmt_vec(row['exact_grad'])} | "
                f"{row['exact_sq_bias']:.3e} | {row['variance']:.3e} | "
                f"{row['variance_mean_baseline']:.3e} |")
        if mc:
            line += f" {row['mc_sq_bias']:.3e} | {row['mc_variance']:.3e} |"
        lines.append(line + f" {'yes' if row['biased'] else 'no'} |")
    sweep = result.get("variance_sweep") or []
    if sweep:
        names = [n for n in VARIANCE_SUMMARY if n in sweep[0]["rows"]]
        lines += ["", "Per-sample variance on-policy (exact; no baseline / mean baseline) of the "
                  "unbiased configurations and of K3 in the loss (biased), at this setting (first "
                  "column) and at others, same model and T:", "",
                  "| config | " + " | ".join(f"theta={s['theta']} ref={s['ref']} KL {s['kl']:.2f}"
                                             for s in sweep) + " |",
                  "|---|" + "---|" * len(sweep)]
        for name in names:
            cells = [f"{s['rows'][name]['variance']:.3g} / {s['rows'][name]['variance_mean_baseline']:.3g}"
                     + (" (biased)" if s["rows"][name]["exact_sq_bias"] > UNBIASED_TOL else "")
                     for s in sweep]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += [""] + _variance_reading(result)
    if "three_distribution" in result:
        lines += three_distribution_markdown(result)
    if "versions" in result:
        lines += versions_markdown(result)
    if "trajectory" in result:
        lines += trajectory_markdown(result)
    if "policy_loss" in result:
        lines += policy_loss_markdown(result)
    lines.append("")
    lines.append(f"Runtime: {result['runtime_s']:.1f} s wall, {result['cpu_s']:.1f} s CPU "
                 f"(torch threads: {torch.get_num_threads()})")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path):
    """Bars of exact squared bias and exact per-sample variance per configuration (paper Fig. 1 style)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-12
    panels = [("on-policy", "on-policy (samples from A_theta)"),
              ("off-policy", "off-policy (samples from A_old)")]
    setup = result["setup"]
    fig, axes = plt.subplots(2, 1, figsize=(16, 10), gridspec_kw={"height_ratios": [1, 1.6]})
    for ax, (sampling, title) in zip(axes, panels):
        rows = [r for r in result["rows"] if r["sampling"] == sampling]
        x = torch.arange(len(rows), dtype=torch.float64).numpy()
        bias = [max(r["exact_sq_bias"], floor) for r in rows]
        var = [max(r["variance"], floor) for r in rows]
        ax.bar(x - 0.2, bias, width=0.4, label="squared bias (exact)", color="tab:red")
        ax.bar(x + 0.2, var, width=0.4, label="variance per sample (exact, no baseline)",
               color="tab:blue")
        ax.set_yscale("log")
        ax.set_xticks(x)
        ax.set_xticklabels([r["config"].replace(" off:", "\n") for r in rows], rotation=60,
                           ha="right", fontsize=7)
        ax.set_title(f"{title}; bars at {floor:g} are unbiased (exact bias^2 ~ 0)", fontsize=10,
                     loc="left")
        ax.legend(fontsize=8, ncol=2, loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.suptitle(f"toy model '{setup['model']}', T={setup['seq_len']}, theta={setup['theta']}, "
                 f"ref={setup['ref']}, old={setup['old']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def study_threads(num_threads: int | None) -> int:
    """The CLI's torch thread count: `num_threads` when given, else OMP_NUM_THREADS when set,
    else 1. Every op of the study is on tensors of at most 2^T rows, where torch's default of
    one thread per core only adds synchronisation (and, with the cores busy, waits on it)."""
    if num_threads is not None:
        return num_threads
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else 1


def main(argv=None) -> int:
    """`megatron-rl toy` / `python tools/toy_kl_study.py`: print the study; write table.md,
    results.json and figure.png under --out."""
    parser = argparse.ArgumentParser(prog="megatron-rl toy", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default="count", help=(
        "toy policy family, p_t = sigmoid(a + b c_{t-1}): count: c_{t-1} = the number of ones "
        "so far (paper eq. 17-18); sign: c_{t-1} = 2 y_{t-1} - 1, the previous token's sign. "
        "Picks the defaults of --theta, --ref and --old (default: %(default)s)"))
    parser.add_argument("--seq-len", type=int, default=ToySetup.seq_len, help=(
        f"T, the sequence length in tokens, 1..{MAX_SEQ_LEN}; the exact columns enumerate all "
        "2^T sequences, so run time and memory grow as 2^T (default: %(default)s)"))
    defaults = ", ".join(f"{m}: {p[0]}, {p[1]}, {p[2]}" for m, p in DEFAULT_PARAMS.items())
    parser.add_argument("--theta", type=float, nargs=2, metavar=("A", "B"), help=(
        "parameters (a, b) of the trained policy A_theta, whose KL gradient is estimated "
        f"(default: unset, the --model's; defaults (theta, ref, old) per model: {defaults})"))
    parser.add_argument("--ref", type=float, nargs=2, metavar=("A", "B"), help=(
        "parameters (a~, b~) of the reference policy B of KL(A_theta || B) (default: unset, "
        "the --model's; see --theta)"))
    parser.add_argument("--old", type=float, nargs=2, metavar=("A", "B"), help=(
        "parameters of the behaviour policy A_old that samples the off-policy rows (default: "
        "unset, the --model's; see --theta)"))
    parser.add_argument("--rollout", type=float, nargs=2, metavar=("A", "B"), help=(
        "parameters of the engine's distribution mu, parameterised as --old: adds the "
        "three-distribution study, samples from mu, the PPO ratio against --old, the KL's "
        "importance weights against pi_old (behaviour) or mu (rollout), and the policy-gradient "
        "rollout corrections (default: unset, no such study)"))
    parser.add_argument("--versions", type=float, nargs=4, metavar=("A_A", "A_B", "B_A", "B_B"),
                        help=(
        "parameters (a, b) of an older weight version A, then of a newer B, parameterised as "
        "--old: adds the versions study, samples whose tokens before the --switch point came "
        "from A and after it from B (a partial rollout that outlived a weight update), the PPO "
        "ratio against --old (the trainer's recompute), the KL's importance weights against "
        "pi_old, each token's own version, or B alone, and the policy-gradient rollout "
        "corrections on each token's own version (default: unset, no such study)"))
    parser.add_argument("--switch", default=ToySetup.switch, help=(
        f"with --versions: where a sample's tokens change version: {SWITCH_HELP} "
        "(default: %(default)s)"))
    parser.add_argument("--is-truncation", type=float, default=ToySetup.is_truncation, help=(
        "with --rollout: c of the truncated variants, min(w, c), of the KL's seq-is weights; "
        "with --rollout or --versions: c of the tis policy-gradient correction "
        "(default: %(default)s)"))
    parser.add_argument("--env-tokens", choices=ENV_LAYOUTS, help=(
        "adds the trajectory study: environment tokens (a tool's output, drawn from a fixed "
        "kernel, --env) between the policy's, which the policy conditions on but did not sample; "
        "call = one environment token after each policy token 1 (a tool call); alternate = one "
        "after every policy token. --seq-len counts both. Every configuration with the "
        "environment's tokens masked out of the loss, charged, and in the seq-is weights "
        "(default: unset, no such study)"))
    env_defaults = ", ".join(f"{m}: {e[0]}, {e[1]}" for m, e in DEFAULT_ENV.items())
    parser.add_argument("--env", type=float, nargs=2, metavar=("E0", "E1"), help=(
        "with --env-tokens: parameters of the environment kernel E(x_t = 1 | h_t) = sigmoid(e0 + "
        "e1 c_{t-1}), c_{t-1} from every earlier token as for the policy (default: unset, the "
        f"--model's: {env_defaults})"))
    parser.add_argument("--policy-loss", choices=POLICY_LOSS_NAMES + ("all",), help=(
        "adds the policy-loss study: every (this --policy-loss x KL estimator k1/k2/k3 x "
        "placement) on-policy and off-policy under each correction, with clipping off and with "
        "the loss's own clipping (ppo-clip, dual-clip 0.2/0.28; gspo, gspo-token 3e-4/4e-4; "
        "cispo 1/0.28; sapo's gate); all: every built-in loss (default: unset, no such study)"))
    parser.add_argument("--loss-aggregation", choices=STUDY_AGGREGATIONS,
                        default=ToySetup.loss_aggregation, help=(
        "with --policy-loss: the study's loss aggregation; seq-mean-token-mean weighs a "
        "sequence's tokens 1/|y| and measures the bias against the per-token-averaged KL "
        "(default: %(default)s)"))
    parser.add_argument("--stop-after-ones", type=int, metavar="K", help=(
        "with --policy-loss: variable lengths in its study: a sequence ends with its K-th "
        "token 1 (the stop token), the positions after it masked out of the loss, or at "
        "--seq-len (default: unset, every sequence has --seq-len tokens)"))
    parser.add_argument("--out", default="outputs/toy", help=(
        "directory for table.md, results.json and figure.png, created when missing "
        "(default: %(default)s)"))
    parser.add_argument("--num-trials", type=int, default=ToySetup.num_trials, help=(
        "Monte-Carlo trials, independent batches of --num-samples sequences each, for the MC "
        "bias and variance columns (0: exact columns only) (default: %(default)s)"))
    parser.add_argument("--num-samples", type=int, default=ToySetup.num_samples, help=(
        "sequences per Monte-Carlo trial (0: exact columns only) (default: %(default)s)"))
    parser.add_argument("--seed", type=int, default=ToySetup.seed, help=(
        "seed of the Monte-Carlo sampler; the exact columns do not depend on it "
        "(default: %(default)s)"))
    parser.add_argument("--json", action="store_true", help=(
        "print the full result as JSON instead of the markdown table; table.md and "
        "results.json are written either way (default: off)"))
    parser.add_argument("--no-plot", action="store_true", help=(
        "do not draw figure.png (nor import matplotlib) (default: off, the figure is written)"))
    parser.add_argument("--num-threads", type=int, help=(
        "torch's CPU threads; the study's tensors are small, so more threads add "
        "synchronisation and, on a busy machine, wait for each other (default: unset, "
        "OMP_NUM_THREADS when set, else 1)"))
    args = parser.parse_args(argv)
    if args.num_threads is not None and args.num_threads < 1:
        parser.error(f"--num-threads must be >= 1, got {args.num_threads}")
    if not 1 <= args.seq_len <= MAX_SEQ_LEN:
        parser.error(f"--seq-len must be in [1, {MAX_SEQ_LEN}] (2^T sequences are enumerated), "
                     f"got {args.seq_len}")
    if not args.is_truncation > 0:
        parser.error(f"--is-truncation must be > 0, got {args.is_truncation}")
    if args.switch != ToySetup.switch and args.versions is None:
        parser.error(f"--switch {args.switch} needs --versions (the study it parameterises)")
    try:
        switch_branches(torch.zeros(1, args.seq_len, dtype=DTYPE), args.switch)
    except ValueError as err:
        parser.error(str(err))
    if args.env is not None and args.env_tokens is None:
        parser.error(f"--env {args.env[0]:g} {args.env[1]:g} needs --env-tokens (the trajectory "
                     "study it parameterises)")

    if args.policy_loss is None:
        for flag, given in (("--loss-aggregation", args.loss_aggregation != ToySetup.loss_aggregation),
                            ("--stop-after-ones", args.stop_after_ones is not None)):
            if given:
                parser.error(f"{flag} needs --policy-loss (the study it parameterises)")
    if args.stop_after_ones is not None and not 1 <= args.stop_after_ones <= args.seq_len:
        parser.error(f"--stop-after-ones must be in [1, --seq-len {args.seq_len}], got "
                     f"{args.stop_after_ones}")
    losses = (None if args.policy_loss is None else
              POLICY_LOSS_NAMES if args.policy_loss == "all" else (args.policy_loss,))

    theta, ref, old = (tuple(given) if given is not None else default
                       for given, default in zip((args.theta, args.ref, args.old),
                                                 DEFAULT_PARAMS[args.model]))
    setup = ToySetup(seq_len=args.seq_len, theta=theta, ref=ref, old=old, model=args.model,
                     num_trials=args.num_trials, num_samples=args.num_samples, seed=args.seed,
                     rollout=tuple(args.rollout) if args.rollout is not None else None,
                     is_truncation=args.is_truncation,
                     versions=((tuple(args.versions[:2]), tuple(args.versions[2:]))
                               if args.versions is not None else None),
                     switch=args.switch, env_tokens=args.env_tokens,
                     env=tuple(args.env) if args.env is not None else None,
                     policy_losses=losses, loss_aggregation=args.loss_aggregation,
                     stop_after=args.stop_after_ones)
    torch.set_num_threads(study_threads(args.num_threads))
    result = run_study(setup)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(result)
    (out / "table.md").write_text(table)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_plot:
        plot(result, out / "figure.png")
    print(json.dumps(result, indent=2) if args.json else table)
    print(f"wrote {out}/table.md, results.json" + ("" if args.no_plot else ", figure.png"),
          file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
