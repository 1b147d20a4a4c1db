"""KL estimators K1/K2/K3 and the placement switch (reward, loss, both, none).

Pure PyTorch on plain tensors; nothing here imports Megatron. Shapes: `logprobs`, `ref_logprobs`,
`old_logprobs` and `loss_mask` are [B, T] (B sequences, T response positions; padded positions
have loss_mask 0, and so do the environment's tokens in a multi-turn sample: every KL term and
importance weight must run over the policy's tokens only, docs/results.md "Trajectories with
environment tokens"). Per token, with log r_t = ref_logprobs_t - logprobs_t (r = pi_ref / pi_theta):

    K1 = -log r                 unbiased for KL(pi_theta || pi_ref) under y_t ~ pi_theta, can be < 0
    K2 = 0.5 (log r)^2          biased, >= 0
    K3 = r - 1 - log r          unbiased (E_{pi_theta}[r] = 1), >= 0, "low variance" (Schulman)

Sequence-level reverse KL, the regularizer of the RL objective:
    KL(pi_theta || pi_ref) = E_{y ~ pi_theta}[ sum_t K1_t ],  with score S(y) = sum_t s_t,
    s_t = grad log pi_theta(y_t | y_<t). Its gradient is (score function; the path-wise part
    E[S] vanishes)  g* = E[(sum_t K1_t) S] = E[sum_t s_t sum_{s>=t} K1_s]  (the second form by
    causality: E[K1_s s_t] = 0 for s < t).

Where the estimator goes decides which gradient one gets (A Comedy of Estimators, arXiv 2512.21852,
Sec. 3; the expected gradients are derived for a toy model in megatron_rl/experiments/toy.py):
- "reward": beta * sum_t K_t is subtracted from the sequence's return (stop-gradient) and reaches
  the policy only through the score function inside the advantage. K1 -> exactly g*
  (unbiased); K3 -> g* + E[sum_t r_t s_t], biased; GRPO-style K3 in reward collapses.
- "loss": beta * K_t is added to the per-token loss and differentiated path-wise only.
  K1 -> E[S] = 0, no regularization at all; K3 -> -E[sum_t r_t s_t], the gradient of the
  token-level *forward* KL(pi_ref || pi_theta) at the visited prefixes, biased (GRPO's default);
  K2 -> E[sum_t K1_t s_t], only the immediate term of g*, biased.
- "reward+loss": both. The sum is the full derivative grad E_{pi_theta}[sum_t K_t], which equals
  g* exactly when E_{pi_theta}[sum_t K_t] = KL, i.e. for K1 and K3 (not K2): unbiased on-policy.
- "none": no KL term.

The exact per-position KL ("exact"; on the toy as megatron_rl/experiments/toy.py's `ExactKL`, in
the trainer `--kl-estimator exact`; not in ESTIMATORS: it needs both full next-token distributions, so the
functions here take its values as `token_kl` instead of computing them from log-probs):
    KL_t(y_<t) = sum_v pi_theta(v|y_<t) (log pi_theta(v|y_<t) - log pi_ref(v|y_<t)) = E[K1_t | y_<t],
a function of the prefix alone (no sampling noise at position t), and
KL(pi_theta || pi_ref) = E_{y ~ pi_theta}[sum_t KL_t]. Both the integrand and the sampling law
depend on theta, so (product rule, log-derivative trick)
    g* = E[sum_t grad KL_t] + E[(sum_s KL_s) S]
       = E[sum_t grad KL_t]               (a) path-wise, at the sampled prefixes
       + E[sum_t s_t sum_{s>t} KL_s]      (b) score function, return = KL of later positions,
because for s <= t, KL_s depends on y_<s only, a part of y_<t, and E[s_t | y_<t] = 0, so
E[s_t KL_s] = 0. In particular position t does not belong in token t's return: s_t KL_t has mean
zero, a pure noise term (keeping it raised the variance in 5 of 6 toy settings; being correlated
with the other terms it can also lower it, so dropping it is not a guaranteed gain). Each term is
a Rao-Blackwellized piece
of the K1 form of g*: (a) = E[sum_t K1_t s_t], since E[K1_t s_t | y_<t] = grad KL_t, and
(b) = E[sum_t s_t sum_{s>t} K1_s]. With K_t = KL_t, beta = 1, the placements give:
- "loss" (sum_t KL_t differentiated): (a) only, = E[grad, K2 in loss]. Biased: misses (b).
- "reward" (sg(KL) in the return): E[(sum_s KL_s) S] = (b), whichever return is used (full
  sum_s, reward-to-go sum_{s>=t}, later sum_{s>t}): the s <= t terms vanish in expectation.
  Biased: misses (a).
- "reward+loss": (a) + (b) = g*. Unbiased with any of the three returns (and any constant or
  leave-one-out baseline); "later positions only" (sum_{s>t}) is the estimator derived above.
  Note that --kl-reward-to-go charges sum_{s>=t}: unbiased too, usually (not always) noisier.
On the toy (exact enumeration of 2^T sequences, float64) reward+loss has bias^2 ~ 1e-31 and the
other two are biased; per-sample variance at the default setting 1.6 against 15.4 for K1 in the
reward (8.8 with reward-to-go), a gain that shrinks far from the reference (docs/results.md).
Off-policy, prefix weights ("seq-is") restore the on-policy expectation as for K1.

In the trainer (`--kl-estimator exact`, any placement; "reward+loss" is the unbiased one):
- KL_t comes from the vocab-parallel op `megatron_rl.ops.exact_kl(logits, ref_logits)` (torch /
  C++ / CUDA kernels; per TP rank only its vocab shard, one MAX and one SUM all-reduce of
  [N]-sized statistics; backward recomputes p and q from both logits, nothing [N, V] kept), with
  gradient p_v (log p_v - log q_v - KL_t) w.r.t. the policy's logits. The loss function gets it
  from the log-prob op itself (`token_logprobs_and_kl(..., ref_logits=...)`), whose backward
  adds it into the one gradient buffer: the K1 path's peak memory, plus the reference's logits
  (benchmarks/RESULTS.md).
- The reference's logits are produced inside the step, not stored or streamed ([B, L, V] per
  batch is too big): `Policy.forward_backward(..., reference=<frozen reference Policy>)` runs
  each microbatch through the reference's stage under no_grad in the same forward step; under
  pipeline parallelism the reference's activations travel with the policy's (see its docstring).
- Reward side: at the start of the RL step one forward-only pass of policy + reference
  (`update.score_reference_exact`) gives KL_t at the current weights (= the behaviour policy's
  on-policy; with stale batches, --async-level, still the current policy's KL, which the
  derivation asks for, where K1's reward side uses the behaviour log-probs) and the reference's
  token log-probs; the return of token t is R - beta sum_{s>t} KL_s
  (`kl_reward_to_go_penalty`: later positions only for "exact", whatever --kl-reward-to-go), then the
  baseline. Loss side: the loss function computes KL_t with its gradient from the policy's and
  the reference's logits of the microbatch (`update.make_rl_loss_fn`). "seq-is" takes the
  reward side out of the advantage as for K1 (`kl_reward_is_surrogate`, per-decision weights
  over the later positions). Cost: one extra policy forward per batch for the reward side, and a
  reference forward per microbatch and optimizer step for the loss side.
- Checked: the per-token loss equals the toy's (tests/ops/test_exact_kl.py), TP2 / PP2 / TP2xPP2
  give TP1's loss and gradients (tests/distributed/test_parallel_equivalence.py).

Off-policy (samples from pi_old != pi_theta) none of the placements above is unbiased for the
sequence-level KL. `off_policy_correction` chooses the fix; see `importance_weights`,
`kl_loss_term` and `kl_reward_is_surrogate` for the bias and variance of each option.

Three distributions. The engine samples y ~ mu (its log-probs: `rollout_logprobs`), the trainer
recomputes pi_old (the PPO ratio's denominator) and trains pi_theta. The token-is / seq-is weights
of the KL divide by pi_old (`is_proposal` "behaviour") or by mu ("rollout"). Per prefix:
    W_<=t = [pi_theta/mu](y_<=t) = w_<=t rho_<=t,   w_<=t = [pi_theta/pi_old](y_<=t),
    rho_<=t = [pi_old/mu](y_<=t) = prod_{s<=t} pi_old(y_s | y_<s) / mu(y_s | y_<s).
For any f of the prefix y_<=t (summing over y_<=t):
    (R1) E_mu[W_<=t f] = E_theta[f]                                        exactly;
    (R2) E_mu[w_<=t f] = E_theta[(mu/pi_old)(y_<=t) f] = Z_t E_{nu_t}[f],
         nu_t(y_<=t) = pi_theta(y_<=t) mu(y_<=t) / (pi_old(y_<=t) Z_t),  Z_t = E_mu[w_<=t],
    so the behaviour weight's bias is E_theta[((mu/pi_old)(y_<=t) - 1) f]: zero for every f only
    when mu = pi_old on the prefixes (then rho = 1 and the two proposals are the same weights).
Every seq-is gradient is a sum of such terms: the reward side W_<=T (sum_s K_s) S or, per
decision, sum_t s_t sum_{s>=t} W_<=s K_s (K_s s_t is a function of y_<=s; exact: s > t), the loss
side sum_t W_<=t grad K_t. Hence:
- seq-is against mu: by (R1) each term keeps its on-policy expectation, so K1 in the reward (full
  or reward-to-go) and K1 / K3 / exact in reward+loss give g* exactly, as seq-is against pi_old
  does when mu = pi_old (the single-sampler derivation with the sampler's weights). pi_old does not
  enter: seq-is keeps the KL out of the advantage, away from the PPO ratio.
- seq-is against pi_old, mu != pi_old: by (R2), for K1 in the reward
      E_mu[w_<=T (sum_s K1_s) S] - g* = E_theta[((mu/pi_old)(y) - 1) (sum_s K1_s) S],
  the shift mu/pi_old of the whole prefix left in (at pi_theta = pi_old, the first minibatch, w = 1
  and the estimator is the uncorrected one on mu's samples). Biased.
- token-is (detached, loss side) against mu: E_mu[(pi_theta/mu)(y_t|y_<t) grad K_t | y_<t] =
  E_theta[grad K_t | y_<t] at prefixes y_<t ~ mu, the single-sampler token-is bias with pi_old
  replaced by mu. Against pi_old: E_theta[(mu/pi_old)(y_t|y_<t) grad K_t | y_<t] at mu's
  prefixes, the token mis-weighted as well. Neither is unbiased for the sequence-level KL.
Policy-gradient term (correction.py). Its token weight is ratio_t c_t with the PPO ratio
(pi_theta/pi_old)(y_t|y_<t) and the rollout weight c_t = (pi_old/mu)(y_t|y_<t), so untruncated
tis with the clip inactive weights token t by (pi_theta/mu)(y_t|y_<t):
    E_mu[(pi_theta/mu)_t A_t s_t | y_<t] = E_{y_t ~ pi_theta, y_>t ~ mu}[A_t s_t | y_<t],
the token corrected, the prefix (and the later tokens inside A_t) still mu's: the usual PPO bias,
measured from mu. seq-mis inside its bounds multiplies by rho_<=T and gives the PPO estimator on
pi_old's samples. A KL inside the advantage (reward placement, correction none or token-is) keeps
that bias under every --rollout-correction. The KL's seq-is weight must carry the whole prefix
ratio itself: W_<=t = w_<=t prod_{s<=t} c_s, the product of the raw rollout weights over the
prefix, not the token's.
Truncation and masks. For v = q/p (so E_p[v f] = E_q[f]) and c > 0:
    E_p[min(v, c) f] = E_q[f] - E_q[(1 - c/v)_+ f],
a bias -E_q[(1 - c/v)_+ f] (the mass where v > c counted at c/v of its weight) for a variance
bounded by c^2 E_p[f^2]; a mask 1{low <= v <= high} (icepop, seq-mis) drops -E_q[1{v outside} f].
With v = W_<=t, q = pi_theta, a truncation of the rollout proposal's weights is biased wherever it
binds. Untruncated, E_mu[W_<=t^2] = 1 + chi^2(pi_theta || mu) over t-token prefixes, which grows
with t (exponentially when each token adds a comparable divergence).
Unbiased for g* on mu's samples: untruncated seq-is against mu, for K1 in the reward (any return)
and K1 / K3 / exact in reward+loss. Not unbiased: seq-is against pi_old when mu != pi_old; any
truncated or masked weight; token-is against either; correction "none"; any KL inside the advantage,
whatever --rollout-correction. Checked by exact enumeration in megatron_rl/experiments/toy.py
(`megatron-rl toy --rollout A B`, docs/results.md): at the setting there, with mu != pi_old, the
unbiased configurations above have bias^2 <= 2.5e-30 against mu and 0.010-0.17 against pi_old.
"""
from dataclasses import dataclass, field

import torch

LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_CLAMP = 10.0


def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """K1 = -log r = logprobs - ref_logprobs, elementwise (any matching shapes, e.g. [B, T]).

    dK1/dlogprobs = 1: as a loss its gradient is the score s_t, zero in expectation on-policy.
    """
    return logprobs - ref_logprobs


def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """K2 = 0.5 (log r)^2 with log r = ref_logprobs - logprobs, elementwise.

    dK2/dlogprobs = -(ref_logprobs - logprobs) = K1.
    """
    log_ratio = ref_logprobs - logprobs
    return 0.5 * log_ratio.square()


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """K3 = r - 1 - log r with r = exp(ref_logprobs - logprobs), elementwise. No clamping.

    dK3/dlogprobs = 1 - r = 1 - exp(ref_logprobs - logprobs).
    """
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio


def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """K3 with the clamps verl and slime use ("low_var_kl"), elementwise.

    log r is clamped to [-20, 20] before exponentiation and the K3 value to [-10, 10]. Where either
    clamp is active the gradient with respect to logprobs is exactly zero (torch.clamp passes no
    gradient outside its range), so tokens whose policy has drifted far from the reference stop
    being pulled back: the clamp trades overflow safety for a silently missing gradient. Inside
    the clamps this is identical to `k3`.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kl = torch.expm1(log_ratio) - log_ratio
    return kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3, "low_var_kl": low_var_kl}
# Estimators computed from both full next-token distributions (not a function of the sampled
# token's log-probs): their per-position values come in as `token_kl` (megatron_rl.ops.exact_kl).
FULL_DISTRIBUTION_ESTIMATORS = ("exact",)
ESTIMATOR_NAMES = tuple(sorted(ESTIMATORS)) + FULL_DISTRIBUTION_ESTIMATORS
PLACEMENTS = ("reward", "loss", "reward+loss", "none")
OFF_POLICY_CORRECTIONS = ("none", "seq-is", "token-is")
IS_PROPOSALS = ("behaviour", "rollout")  # what the KL's importance weights divide by


def get_estimator(name: str):
    """The estimator function registered under `name`; ValueError listing valid names otherwise.
    "exact" has no function of log-probs (its values come from both logits, see `_token_kl`)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; valid: {list(ESTIMATOR_NAMES)}"
                         + (" (the exact KL is computed from logits: pass token_kl)"
                            if name in FULL_DISTRIBUTION_ESTIMATORS else ""))
    return ESTIMATORS[name]


class Placement:
    """The placement switch's two halves, in one place for KLConfig and the toy's ExactKL (a
    class with a `placement` field, one of PLACEMENTS)."""

    placement: str

    @property
    def in_reward(self) -> bool:
        return self.placement in ("reward", "reward+loss")

    @property
    def in_loss(self) -> bool:
        return self.placement in ("loss", "reward+loss")


@dataclass
class KLConfig(Placement):
    """How the KL regularizer beta * KL(pi_theta || pi_ref) enters training.

    estimator: a key of ESTIMATORS, or "exact" (the per-position KL from both full next-token
        distributions; every placement is allowed, "reward+loss" is the unbiased one, see the
        module docstring; the functions below then take its values as `token_kl`).
    placement: one of PLACEMENTS. coef: beta.
    reward_to_go: in the reward placement, token t is credited only with sum_{s>=t} K_s instead of
        the whole sequence sum (paper App. F.3). Same expectation (causality), lower variance.
        No effect with "exact", whose reward side always charges token t with the later
        positions' KL, sum_{s>t} KL_s (the score-function term of the derivation).
    off_policy_correction: one of OFF_POLICY_CORRECTIONS, for samples drawn from pi_old:
        "none": the placements as on-policy; the reward-side KL rides the PPO per-token ratio like
            any reward. Biased off-policy.
        "token-is": KL loss term weighted by omega_t = pi_theta/pi_old per token (Zhang et al.
            2025; DeepSeek-V3.2). Corrects the token distribution, not the prefix distribution:
            biased for the sequence-level KL, bounded variance.
        "seq-is": prefix-level importance weights pi_theta(y_<=t)/pi_old(y_<=t) on both sides;
            the reward-side KL is taken out of the advantage and handled by
            `kl_reward_is_surrogate`. Unbiased for K1 (reward, reward+loss) and K3 (reward+loss)
            when not truncated; variance grows exponentially with the divergence of pi_old.
    is_truncation: if set, importance weights are truncated at this value (min(w, c)):
        bounded variance, biased towards the uncorrected estimator.
    is_weight_grad: "token-is" only: let the gradient flow through omega_t (grad(omega K) =
        omega (K s + grad K)), which makes the loss term the gradient of the token-level
        E_{pi_theta}[K_t] at each visited prefix; detached (default) keeps only omega grad K.
    """

    estimator: str = field(default="k1", metadata={"choices": list(ESTIMATOR_NAMES), "help": (
        "per-token estimator K_t of KL(pi || pi_ref), log r = log pi_ref - log pi: k1 = -log "
        "r; k2 = (log r)^2 / 2; k3 = r - 1 - log r; low_var_kl = k3 with verl/slime's clamps "
        "(no gradient where a clamp is active); exact = the per-position KL from both full "
        "distributions (a reference forward inside the step). Which gradient it gives depends "
        "on --kl-placement: k1 in the reward is the unbiased gradient of the sequence-level "
        "reverse KL (the default); k3 in the loss (GRPO's default) is biased: the gradient of "
        "the token-level forward KL; k1 in the loss has zero expected gradient (no "
        "regularisation); k3 in the reward is biased; reward+loss is unbiased on-policy for "
        "k1, k3 and exact")})
    placement: str = field(default="reward", metadata={"choices": list(PLACEMENTS), "help": (
        "where the KL enters: reward = --kl-coef x sum_t K_t subtracted from each response's "
        "return (stop-gradient; it reaches the policy through the advantage); loss = "
        "--kl-coef x K_t added to each token's loss (differentiated path-wise); reward+loss = "
        "both; none = no KL term (the KL is still logged)")})
    coef: float = field(default=0.05, metadata={"min": 0.0, "help": (
        "beta: the weight of the KL term")})
    reward_to_go: bool = field(default=False, metadata={"help": (
        "reward placement: credit token t with the KL of positions s >= t only instead of the "
        "whole sequence's (same expectation, lower variance). No effect with exact, whose "
        "reward side always charges the later positions' KL")})
    off_policy_correction: str = field(default="none", metadata={
        "choices": list(OFF_POLICY_CORRECTIONS), "help": (
        "the KL of samples from an older policy (--ppo-minibatches > 1, --async-level): none "
        "= as on-policy (biased off-policy); token-is = the KL loss term weighted by "
        "pi/pi_old per token (biased for the sequence-level KL, bounded variance); seq-is = "
        "prefix-level importance weights on both sides (unbiased for k1 and, in reward+loss, "
        "k3 when not truncated; variance grows with the divergence)")})
    is_truncation: float | None = field(default=None, metadata={"help": (
        "truncate the importance weights of --kl-off-policy-correction at this value (min(w, "
        "c)): bounded variance, biased towards the uncorrected estimator; unset: no "
        "truncation")})
    is_weight_grad: bool = field(default=False, metadata={"help": (
        "token-is only: let the gradient flow through the weight pi/pi_old, which makes the "
        "loss term the gradient of the token-level KL at each visited prefix; off: the weight "
        "is detached")})
    is_proposal: str = field(default="behaviour", metadata={
        "choices": list(IS_PROPOSALS), "help": (
            "the distribution the token-is / seq-is weights pi/q divide by: behaviour = the "
            "trainer's pi_old (its recompute, or the engine's log-probs under --old-logprobs "
            "rollout); rollout = the engine's log-probs mu, the distribution that sampled. Only "
            "rollout makes seq-is unbiased when the engine's numerics or weights differ from "
            "pi_old (kl.py's three-distribution derivation)")})

    def validate(self) -> None:
        """The rules beyond each field's declared choices and minimum (which the trainer's
        TrainConfig.validate checks)."""
        if self.is_truncation is not None and self.is_truncation <= 0:
            raise ValueError(f"--kl-is-truncation {self.is_truncation}: must be > 0 (unset: no "
                             "truncation)")

    @property
    def exact(self) -> bool:
        """The estimator is computed from both full distributions (needs `token_kl`)."""
        return self.estimator in FULL_DISTRIBUTION_ESTIMATORS

    @property
    def differentiated(self) -> bool:
        """A KL term is differentiated in the loss function: the loss placement, or the reward
        under "seq-is" (its surrogate, `kl_reward_is_surrogate`), which needs the reference."""
        return self.in_loss or (self.in_reward and not self.reward_in_advantage)

    @property
    def exact_kl_in_loss(self) -> bool:
        """The loss function needs the exact KL with its gradient (so the reference's logits):
        in the loss, or in the reward under "seq-is" (its surrogate takes the KL at the current
        policy)."""
        return self.exact and self.differentiated

    @property
    def reward_in_advantage(self) -> bool:
        """Whether the reward-side KL is folded into the returns before the baseline (eq. 7-8).

        Under "seq-is" it is not: its importance weight must multiply only the KL part, so the loss
        adds it as a separate surrogate (`kl_reward_is_surrogate`).
        """
        return self.in_reward and self.off_policy_correction != "seq-is"


def _token_kl(logprobs, ref_logprobs, loss_mask, cfg: KLConfig,
              token_kl: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] K_t of cfg.estimator, zero where loss_mask is 0. For "exact", `token_kl` [B, T]
    holds KL_t (megatron_rl.ops.exact_kl of the policy's and the reference's logits)."""
    if cfg.exact:
        if token_kl is None:
            raise ValueError(f"KL estimator {cfg.estimator!r} needs token_kl: the per-position KL "
                             "from the policy's and the reference's logits (ops.exact_kl)")
        return token_kl * loss_mask
    return get_estimator(cfg.estimator)(logprobs, ref_logprobs) * loss_mask


def _reverse_cumsum(x: torch.Tensor, exclusive: bool = False) -> torch.Tensor:
    """[B, T] -> [B, T] with out[:, t] = sum_{s >= t} x[:, s] (s > t when exclusive)."""
    out = x.flip(-1).cumsum(-1).flip(-1)
    return out - x if exclusive else out


def kl_reward_penalty(logprobs, ref_logprobs, loss_mask, cfg: KLConfig) -> torch.Tensor:
    """[B] sequence penalty beta * sum_t K_t, stop-gradient (to be subtracted from the return).

    logprobs, ref_logprobs, loss_mask: [B, T]. Not for "exact" (see kl_reward_to_go_penalty).
    """
    with torch.no_grad():
        return cfg.coef * _token_kl(logprobs, ref_logprobs, loss_mask, cfg).sum(-1)


def kl_reward_to_go_penalty(logprobs, ref_logprobs, loss_mask, cfg: KLConfig,
                            token_kl: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] per-token penalty beta * sum_{s>=t} K_s (paper App. F.3), stop-gradient, 0 on padding.

    For "exact" (token_kl = KL_t, see _token_kl) beta * sum_{s>t} KL_s: the return of the
    score-function term (b) of the module docstring. KL_t itself is left out, as it does not
    depend on y_t (s_t KL_t has mean zero: noise)."""
    with torch.no_grad():
        kl = _token_kl(logprobs, ref_logprobs, loss_mask, cfg, token_kl)
        return cfg.coef * _reverse_cumsum(kl, exclusive=cfg.exact) * loss_mask


def importance_weights(logprobs, old_logprobs, loss_mask, level: str,
                       truncation: float | None = None) -> torch.Tensor:
    """[B, T] importance weights pi_theta / pi_old, detached, for samples drawn from pi_old.

    level "token": omega_t = exp(logprobs_t - old_logprobs_t), the per-token ratio.
    level "prefix": w_{<=t} = exp(sum_{s<=t} (logprobs_s - old_logprobs_s)), the ratio of the
        prefix probabilities; its last valid entry is the sequence weight pi_theta(y)/pi_old(y).
        E_old[w_{<=t} f(y_<=t)] = E_theta[f(y_<=t)] exactly, for any f of the prefix: unbiased,
        but the variance is that of a product of t ratios (exponential in the divergence).
    truncation c: min(w, c): bounded variance (<= c^2 E_old[f^2]) at the price of the bias
        -E_theta[(1 - c/w)_+ f]: sequences with w > c are counted with weight c instead of w.
    Padded positions get weight 0.
    """
    log_w = (logprobs - old_logprobs).detach() * loss_mask
    if level == "prefix":
        log_w = log_w.cumsum(-1)
    elif level != "token":
        raise ValueError(f"unknown importance weight level {level!r}; valid: ['token', 'prefix']")
    weights = log_w.exp()
    if truncation is not None:
        weights = weights.clamp(max=truncation)
    return weights * loss_mask


def kl_loss_term(logprobs, ref_logprobs, loss_mask, cfg: KLConfig,
                 old_logprobs: torch.Tensor | None = None,
                 token_kl: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] per-token loss contribution beta * weight_t * K_t, differentiable in logprobs (for
    "exact": K_t = token_kl, differentiable in the policy's logits through ops.exact_kl).

    The caller adds it only when cfg.in_loss. weight_t by cfg.off_policy_correction:
    - "none": 1. On-policy its expected gradient is E[sum_t grad K_t] (see the module docstring);
      off-policy the prefixes and tokens come from pi_old: biased.
    - "token-is": omega_t (detached unless cfg.is_weight_grad), Zhang et al. 2025 / DeepSeek-V3.2.
      Detached: E_old[omega_t grad K_t | y_<t] = E_theta[grad K_t | y_<t], the on-policy per-token
      loss gradient, but at prefixes drawn from pi_old (bias from the prefix shift; low variance).
      With gradient: adds omega_t K_t s_t, giving grad E_theta[K_t | y_<t], the token-level
      reverse KL gradient (K1, K3) at pi_old's prefixes, still not the sequence-level one.
    - "seq-is": the prefix weight w_{<=t} (detached): the on-policy expectation exactly,
      E_old[w_{<=t} grad K_t] = E_theta[grad K_t]; unbiased for the loss side, high variance.
    Truncation (cfg.is_truncation) applies to either weight.
    """
    kl = _token_kl(logprobs, ref_logprobs, loss_mask, cfg, token_kl)
    correction = cfg.off_policy_correction
    if correction == "none":
        return cfg.coef * kl
    if old_logprobs is None:
        raise ValueError(f"off_policy_correction={correction!r} needs old_logprobs")
    if correction == "token-is":
        if cfg.is_weight_grad:
            omega = ((logprobs - old_logprobs) * loss_mask).exp()
            if cfg.is_truncation is not None:
                omega = omega.clamp(max=cfg.is_truncation)
            return cfg.coef * omega * kl
        weights = importance_weights(logprobs, old_logprobs, loss_mask, "token", cfg.is_truncation)
    else:
        weights = importance_weights(logprobs, old_logprobs, loss_mask, "prefix", cfg.is_truncation)
    return cfg.coef * weights * kl


def kl_reward_is_surrogate(logprobs, ref_logprobs, old_logprobs, loss_mask,
                           cfg: KLConfig, token_kl: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] per-token surrogate for the reward-side KL under "seq-is"; differentiable in logprobs.

    Target: g* = grad KL(pi_theta || pi_ref) = E_theta[(sum_s K1_s) S]
                = E_old[(pi_theta(y)/pi_old(y)) (sum_s K1_s) S]   (samples y ~ pi_old).
    Two things are needed for this to be unbiased: the weight w = pi_theta(y)/pi_old(y) and the KL
    evaluated at the *current* policy (K from logprobs, not from old_logprobs: with K at pi_old the
    expectation misses E_theta[log(pi_theta/pi_old) S], which is not 0). Surrogate per token:
        beta * sg(w) * sg(sum_s K_s) * logprobs_t,   gradient beta * w * (sum_s K_s) * s_t.
    With reward_to_go the token-t return sum_{s>=t} K_s uses per-decision weights
    sum_{s>=t} w_{<=s} K_s: unbiased too (K_s s_t depends on y_<=s only) and lower variance.
    No baseline is subtracted from the KL part here. Unbiased for K1 (and for K3 when the loss side
    is also on); truncation (cfg.is_truncation) bounds the variance at the price of bias.
    "exact" (token_kl = KL_t at the current policy): the later positions' per-decision return
    sum_{s>t} w_{<=s} KL_s, whatever cfg.reward_to_go; unbiased with the loss side on.
    """
    with torch.no_grad():
        kl = _token_kl(logprobs, ref_logprobs, loss_mask, cfg, token_kl)
        prefix_w = importance_weights(logprobs, old_logprobs, loss_mask, "prefix", cfg.is_truncation)
        if cfg.exact or cfg.reward_to_go:
            returns = _reverse_cumsum(prefix_w * kl, exclusive=cfg.exact)
        else:
            last = (loss_mask.cumsum(-1) == loss_mask.sum(-1, keepdim=True)) & (loss_mask > 0)
            seq_w = (prefix_w * last).sum(-1, keepdim=True)
            returns = seq_w * kl.sum(-1, keepdim=True)
    return cfg.coef * returns * logprobs * loss_mask
