"""The estimator x placement sweep of the paper's Table 1, and how its runs are judged.

Pure functions on plain Python data (no torch, no I/O): ``tools/reproduce.py`` launches the runs,
reads their ``metrics.jsonl`` rows and hands them here.

1. Specification. A run is a ``RunSpec``: a KL configuration (``CONFIGS``, e.g. ``k3:loss``), a
   beta, a seed and a sampling regime (``REGIMES``: ``on`` = one optimizer step per rollout
   batch, ``off`` = 4 PPO minibatches per batch, ``async<k>`` = rollouts up to k steps stale).
   ``build_sweep`` crosses them; ``none`` (no KL term) is run once per seed and regime, not once
   per beta, since beta does not enter it. ``SLICES`` names subsets of CONFIGS (``grid``: the
   paper's Table 1, the default; ``exact``: the exact estimator beside K1 in reward, K3 in
   loss and no KL; ``losses``: K1 in reward and K3 in loss, crossed with policy losses). A
   run's ``--policy-loss`` (``POLICY_LOSS_CLIPS``: each loss with its own clip range) is the
   trainer's default unless the sweep crosses losses; only a non-default loss enters the run id
   and the flags, so default runs keep their ids and commands.
2. Verdicts. ``detect_instability`` and ``detect_collapse`` apply the explicit criteria of
   ``StabilityCriteria`` / ``CollapseCriteria`` (thresholds documented on each field) to one
   run's rows and return the reasons found; an empty list means "not detected".
3. Aggregation. ``summarize_run`` reduces one run to its final numbers, ``aggregate`` groups the
   seeds of one (policy loss, config, beta, regime) into mean +- std, and ``markdown_table``
   prints them.

Row keys used (written by megatron_rl.train): ``step``, ``reward/mean``, ``eval/mean_at_k``,
``kl_k1`` (token-mean K1 to the reference on the batch), ``grad_norm`` (before clipping),
``skipped_update`` (1.0 when the NaN/inf guard dropped the update), ``loss``/``pg_loss``,
``entropy``, ``response/length_mean``.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Iterable, Sequence

# name -> (--kl-estimator, --kl-placement); "none" keeps k1 only so the logged KL is comparable
CONFIGS: dict[str, tuple[str, str]] = {
    "none": ("k1", "none"),
    "k1:reward": ("k1", "reward"),
    "k1:loss": ("k1", "loss"),
    "k1:reward+loss": ("k1", "reward+loss"),
    "k3:reward": ("k3", "reward"),
    "k3:loss": ("k3", "loss"),
    "k3:reward+loss": ("k3", "reward+loss"),
    # the exact per-position KL (--kl-estimator exact, derivation in megatron_rl/kl.py)
    "exact:reward": ("exact", "reward"),
    "exact:reward+loss": ("exact", "reward+loss"),
}
# The paper's Table 1, "Behavior" column (on-policy), as claims to check.
PAPER_BEHAVIOR: dict[str, str] = {
    "none": "no regularization (baseline)",
    "k1:reward": "unbiased, stable, best",
    "k1:loss": "no regularization (zero expected gradient), unstable",
    "k1:reward+loss": "unbiased on-policy",
    "k3:reward": "biased, collapses",
    "k3:loss": "biased, stable, worse out of domain (GRPO default)",
    "k3:reward+loss": "unbiased on-policy",
    # not in the paper: this repository's derivation (megatron_rl/kl.py), checked on the toy
    "exact:reward": "biased (score-function half only)",
    "exact:reward+loss": "unbiased on-policy, lower variance than K1 in reward",
}
# Named subsets of CONFIGS that tools/reproduce.py runs with --slice: "grid" is the paper's
# Table 1 (the 162-run CPU grid; the default of build_sweep), "exact" the exact estimator
# beside the two references (K1 in reward, K3 in loss) and no KL.
SLICES: dict[str, tuple[str, ...]] = {
    "grid": tuple(c for c in CONFIGS if not c.startswith("exact:")),
    "exact": ("none", "k1:reward", "k3:loss", "exact:reward", "exact:reward+loss"),
    "losses": ("k1:reward", "k3:loss"),
}
# The trainer's --policy-loss default; its runs pass no policy-loss or clip flag.
DEFAULT_POLICY_LOSS = "ppo-clip"
# --policy-loss -> (--clip-low, --clip-high) a sweep passes with it; None: the trainer's defaults
# (0.2 / 0.2). GSPO clips the sequence ratio (a geometric mean of token ratios, within ~1e-3 of
# 1), hence its 3e-4 / 4e-4 (the GSPO paper's); CISPO as MiniMax: no lower clip, 0.28 above.
POLICY_LOSS_CLIPS: dict[str, tuple[float, float] | None] = {
    "ppo-clip": None,
    "dual-clip": None,
    "gspo": (3e-4, 4e-4),
    "gspo-token": (3e-4, 4e-4),
    "cispo": (1.0, 0.28),
    "sapo": None,
}
# The policy losses a slice crosses with its configs by default (others: the trainer's default).
SLICE_POLICY_LOSSES: dict[str, tuple[str, ...]] = {"losses": ("ppo-clip", "gspo", "cispo")}
TRAINER_CLIPS = (0.2, 0.2)   # megatron_rl.loss.LossConfig's clip_low / clip_high defaults


def clip_range(policy_loss: str) -> tuple[float, float]:
    """The (clip_low, clip_high) a run of ``policy_loss`` trains with."""
    return POLICY_LOSS_CLIPS[policy_loss] or TRAINER_CLIPS
# The async slice: configs run with --async-level k (name -> extra flags beyond CONFIGS).
ASYNC_CONFIGS: dict[str, tuple[str, str, str]] = {
    "none": ("k1", "none", "none"),
    "k1:reward": ("k1", "reward", "none"),
    "k3:loss": ("k3", "loss", "none"),
    "k1:reward+seq-is": ("k1", "reward", "seq-is"),
}
DEFAULT_BETAS = (0.05, 0.1, 0.3, 1.0)
DEFAULT_SEEDS = (1, 2, 3)
OFF_POLICY_MINIBATCHES = 4


def regime_flags(regime: str) -> dict[str, int]:
    """``on`` -> 1 minibatch; ``off`` -> 4 minibatches; ``async<k>`` -> 1 minibatch, async k."""
    if regime == "on":
        return {"ppo_minibatches": 1, "async_level": 0}
    if regime == "off":
        return {"ppo_minibatches": OFF_POLICY_MINIBATCHES, "async_level": 0}
    if regime.startswith("async") and regime[5:].isdigit() and int(regime[5:]) > 0:
        return {"ppo_minibatches": 1, "async_level": int(regime[5:])}
    raise ValueError(f"unknown regime {regime!r}; valid: on, off, async<k> (k >= 1)")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    config: str                 # a CONFIGS or ASYNC_CONFIGS name
    beta: float                 # 0.0 for "none"
    seed: int
    regime: str = "on"          # on | off | async<k>
    policy_loss: str = DEFAULT_POLICY_LOSS   # a POLICY_LOSS_CLIPS name

    def __post_init__(self):
        table = ASYNC_CONFIGS if self.regime.startswith("async") else CONFIGS
        if self.config not in table:
            raise ValueError(f"unknown config {self.config!r} for regime {self.regime!r}; "
                             f"valid: {sorted(table)}")
        regime_flags(self.regime)
        if self.policy_loss not in POLICY_LOSS_CLIPS:
            raise ValueError(f"unknown --policy-loss {self.policy_loss!r}; valid: "
                             f"{list(POLICY_LOSS_CLIPS)}")

    @property
    def kl(self) -> tuple[str, str, str]:
        """(estimator, placement, off-policy correction)."""
        if self.regime.startswith("async"):
            return ASYNC_CONFIGS[self.config]
        return (*CONFIGS[self.config], "none")

    @property
    def run_id(self) -> str:
        """A directory name: ``k3-loss_b0.05_s1_on`` (``none_s1_on`` without a beta), prefixed
        by a non-default policy loss: ``gspo_k3-loss_b0.05_s1_on``."""
        name = self.config.replace(":", "-").replace("+", "_")
        beta = "" if self.config == "none" else f"_b{self.beta:g}"
        loss = "" if self.policy_loss == DEFAULT_POLICY_LOSS else f"{self.policy_loss}_"
        return f"{loss}{name}{beta}_s{self.seed}_{self.regime}"

    @property
    def group(self) -> tuple[str, str, float, str]:
        return (self.policy_loss, self.config, self.beta, self.regime)

    def train_flags(self) -> list[str]:
        """The KL-, regime- and (non-default) policy-loss-specific `megatron_rl.train` flags."""
        estimator, placement, correction = self.kl
        r = regime_flags(self.regime)
        flags = ["--kl-estimator", estimator, "--kl-placement", placement,
                 "--kl-coef", f"{self.beta:g}", "--kl-off-policy-correction", correction,
                 "--ppo-minibatches", str(r["ppo_minibatches"]),
                 "--async-level", str(r["async_level"]), "--seed", str(self.seed)]
        if self.policy_loss != DEFAULT_POLICY_LOSS:
            flags += ["--policy-loss", self.policy_loss]
            if POLICY_LOSS_CLIPS[self.policy_loss] is not None:
                low, high = clip_range(self.policy_loss)
                flags += ["--clip-low", f"{low:g}", "--clip-high", f"{high:g}"]
        return flags


def build_sweep(configs: Iterable[str] = SLICES["grid"], betas: Iterable[float] = DEFAULT_BETAS,
                seeds: Iterable[int] = DEFAULT_SEEDS, regimes: Iterable[str] = ("on", "off"),
                async_levels: Iterable[int] = (), async_configs: Iterable[str] = tuple(ASYNC_CONFIGS),
                async_betas: Iterable[float] | None = None,
                policy_losses: Iterable[str] = (DEFAULT_POLICY_LOSS,)) -> list[RunSpec]:
    """The cross product, ``none`` once per (seed, regime, policy loss), then the async slice.

    Ordered seed-major (all configs of seed 1 before seed 2) so an interrupted sweep has a
    complete first seed. The async slice uses ``async_betas`` (default: the first beta).
    ``policy_losses`` is crossed with everything (default: the trainer's loss only).
    """
    configs, betas, seeds, regimes = list(configs), list(betas), list(seeds), list(regimes)
    async_betas = list(async_betas) if async_betas is not None else betas[:1]
    losses = list(policy_losses)
    specs: list[RunSpec] = []
    for seed in seeds:
        for regime in regimes:
            for loss in losses:
                for config in configs:
                    for beta in ([0.0] if config == "none" else betas):
                        specs.append(RunSpec(config, beta, seed, regime, loss))
        for k in async_levels:
            for loss in losses:
                for config in async_configs:
                    for beta in ([0.0] if config == "none" else async_betas):
                        specs.append(RunSpec(config, beta, seed, f"async{k}", loss))
    seen: set = set()
    return [s for s in specs if not (s in seen or seen.add(s))]


# ----------------------------------------------------------------------------------------------
# Verdicts
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StabilityCriteria:
    """A run is *unstable* when any of these fires (each is reported by name):

    - ``aborted``: the trainer exited non-zero (e.g. --max-nonfinite-steps consecutive NaN/inf
      updates raised FloatingPointError).
    - ``nonfinite``: some step logged ``skipped_update`` = 1 (the NaN/inf guard dropped the
      update) or a non-finite ``loss`` / ``grad_norm`` / ``kl_k1``.
    - ``grad_spike``: at some step t > ``window``, ``grad_norm[t]`` exceeds ``grad_spike_factor``
      times the median of the ``window`` preceding grad norms (pre-clipping norms; clipping
      bounds the update, not the norm, so a spike still says the loss surface blew up). With
      several PPO minibatches per step the trainer also logs ``grad_norm_max`` (the largest over
      the step's optimizer updates); that series is used where every row has it, so a spike in
      an early minibatch is not averaged away.
    - ``kl_blowup``: the ``window``-step moving average of ``kl_k1`` (nats per token, to the
      reference) exceeds ``kl_max`` at some step.
    """
    window: int = 5
    grad_spike_factor: float = 10.0
    kl_max: float = 1.0


@dataclasses.dataclass(frozen=True)
class CollapseCriteria:
    """A run has *collapsed* when any of these fires (each is reported by name):

    - ``reward_collapse``: the last ``window``-step moving average of the training reward is below
      ``frac`` times the best moving average seen, given that best is at least ``min_best``.
    - ``eval_collapse``: the final held-out mean@k is below ``frac`` times the best held-out
      mean@k seen (the base model's, when given, counts), given that best is >= ``min_best``.
    - ``length_collapse``: the last moving average of the response length is below
      ``length_frac`` times the first (responses shrinking to nothing).
    - ``entropy_collapse``: the last moving average of the token entropy is below
      ``entropy_frac`` times the first.
    """
    window: int = 5
    frac: float = 0.5
    min_best: float = 0.05
    length_frac: float = 0.5
    entropy_frac: float = 0.1


def _series(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if key in r]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def detect_instability(rows: Sequence[dict], returncode: int = 0,
                       criteria: StabilityCriteria = StabilityCriteria()) -> list[str]:
    """The ``StabilityCriteria`` that fire on one run's rows, e.g. ``["grad_spike@17"]``."""
    reasons = []
    if returncode != 0:
        reasons.append(f"aborted(rc={returncode})")
    bad = [int(r["step"]) for r in rows
           if float(r.get("skipped_update", 0.0)) > 0
           or any(k in r and not math.isfinite(float(r[k])) for k in ("loss", "grad_norm", "kl_k1"))]
    if bad:
        reasons.append(f"nonfinite@{bad[0]}")
    key = "grad_norm_max" if rows and all("grad_norm_max" in r for r in rows) else "grad_norm"
    gn = [(s, v) for s, v in _series(rows, key) if math.isfinite(v)]
    w = criteria.window
    for i in range(w, len(gn)):
        med = statistics.median(v for _, v in gn[i - w:i])
        if med > 0 and gn[i][1] > criteria.grad_spike_factor * med:
            reasons.append(f"grad_spike@{gn[i][0]}")
            break
    kl = [(s, v) for s, v in _series(rows, "kl_k1") if math.isfinite(v)]
    for (s, _), avg in zip(kl, moving_average([v for _, v in kl], w)):
        if avg > criteria.kl_max:
            reasons.append(f"kl_blowup@{s}")
            break
    return reasons


def detect_collapse(rows: Sequence[dict], base_eval: float | None = None,
                    criteria: CollapseCriteria = CollapseCriteria()) -> list[str]:
    """The ``CollapseCriteria`` that fire on one run's rows, e.g. ``["reward_collapse"]``."""
    reasons = []
    w = criteria.window
    reward = moving_average([v for _, v in _series(rows, "reward/mean")], w)
    if reward:
        best = max(reward)
        if best >= criteria.min_best and reward[-1] < criteria.frac * best:
            reasons.append(f"reward_collapse({reward[-1]:.3f}<{criteria.frac:g}x{best:.3f})")
    evals = [v for _, v in _series(rows, "eval/mean_at_k")]
    if evals:
        best = max(evals + ([base_eval] if base_eval is not None else []))
        if best >= criteria.min_best and evals[-1] < criteria.frac * best:
            reasons.append(f"eval_collapse({evals[-1]:.3f}<{criteria.frac:g}x{best:.3f})")
    for key, frac, name in (("response/length_mean", criteria.length_frac, "length_collapse"),
                            ("entropy", criteria.entropy_frac, "entropy_collapse")):
        ma = moving_average([v for _, v in _series(rows, key)], w)
        if len(ma) > w and ma[0] > 0 and ma[-1] < frac * ma[0]:
            reasons.append(f"{name}({ma[-1]:.3g}<{frac:g}x{ma[0]:.3g})")
    return reasons


def verdict(instability: Sequence[str], collapse: Sequence[str]) -> str:
    """``stable`` | ``unstable`` | ``collapsed`` | ``unstable+collapsed``."""
    parts = (["unstable"] if instability else []) + (["collapsed"] if collapse else [])
    return "+".join(parts) or "stable"


# ----------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------
def is_complete(rows: Sequence[dict], steps: int, ood: dict | None, need_ood: bool = True) -> bool:
    """A run's results are complete: its last logged step is ``steps``, that row has the
    in-domain eval, and (when ``need_ood``) the OOD result exists."""
    if not rows or int(rows[-1]["step"]) != steps or "eval/mean_at_k" not in rows[-1]:
        return False
    return ood is not None or not need_ood


def summarize_run(spec: RunSpec, rows: Sequence[dict], ood_mean_at_k: float | None = None,
                  returncode: int = 0, base_eval: float | None = None,
                  stability: StabilityCriteria = StabilityCriteria(),
                  collapse: CollapseCriteria = CollapseCriteria()) -> dict:
    """One run -> its final numbers and verdict (a flat dict, JSON-ready)."""
    w = stability.window
    evals = _series(rows, "eval/mean_at_k")
    tail = rows[-w:]
    mean_of = lambda key: (statistics.fmean(float(r[key]) for r in tail if key in r)  # noqa: E731
                           if any(key in r for r in tail) else None)
    inst = detect_instability(rows, returncode, stability)
    coll = detect_collapse(rows, base_eval, collapse)
    return {
        "run_id": spec.run_id, "config": spec.config, "beta": spec.beta, "seed": spec.seed,
        "regime": spec.regime, "policy_loss": spec.policy_loss,
        "steps": int(rows[-1]["step"]) if rows else 0,
        "eval_mean_at_k": evals[-1][1] if evals else None,
        "eval_best_mean_at_k": max(v for _, v in evals) if evals else None,
        "ood_mean_at_k": ood_mean_at_k,
        "reward_final": mean_of("reward/mean"), "kl_k1_final": mean_of("kl_k1"),
        "entropy_final": mean_of("entropy"),
        "instability": inst, "collapse": coll, "verdict": verdict(inst, coll),
    }


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, sample std or None for n < 2, n) over the non-None values."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None, None, 0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None), len(xs)


def aggregate(summaries: Iterable[dict]) -> list[dict]:
    """Group run summaries by (policy loss, config, beta, regime): mean +- std over seeds and
    verdict counts. Rows come back by regime, then policy loss (POLICY_LOSS_CLIPS order), then
    CONFIGS order, then beta."""
    groups: dict[tuple, list[dict]] = {}
    for s in summaries:
        loss = s.get("policy_loss", DEFAULT_POLICY_LOSS)
        groups.setdefault((s["config"], s["beta"], s["regime"], loss), []).append(s)
    order = list(CONFIGS) + [c for c in ASYNC_CONFIGS if c not in CONFIGS]
    losses = list(POLICY_LOSS_CLIPS)
    out = []
    for (config, beta, regime, loss), runs in sorted(
            groups.items(), key=lambda kv: (regime_order(kv[0][2]), losses.index(kv[0][3]),
                                            order.index(kv[0][0])
                                            if kv[0][0] in order else len(order), kv[0][1])):
        row = {"config": config, "beta": beta, "regime": regime, "policy_loss": loss,
               "num_seeds": len(runs), "seeds": sorted(r["seed"] for r in runs)}
        for key in ("eval_mean_at_k", "ood_mean_at_k", "reward_final", "kl_k1_final",
                    "entropy_final"):
            row[key] = mean_std([r[key] for r in runs])
        row["num_unstable"] = sum(bool(r["instability"]) for r in runs)
        row["num_collapsed"] = sum(bool(r["collapse"]) for r in runs)
        row["reasons"] = sorted({x.split("@")[0].split("(")[0] for r in runs
                                 for x in r["instability"] + r["collapse"]})
        out.append(row)
    return out


def regime_order(regime: str) -> tuple[int, int]:
    """Sort key of a regime: on-policy, off-policy, then the others by their number."""
    if regime == "on":
        return (0, 0)
    if regime == "off":
        return (1, 0)
    return (2, int(regime[5:]) if regime[5:].isdigit() else 0)


def format_mean_std(ms: tuple[float | None, float | None, int], digits: int = 3) -> str:
    mean, std, n = ms
    if mean is None:
        return "n/a"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def stability_cell(row: dict) -> str:
    """``stable (3/3)``, or the counts and the criteria that fired."""
    n = row["num_seeds"]
    if not row["num_unstable"] and not row["num_collapsed"]:
        return f"stable ({n}/{n})"
    parts = []
    if row["num_unstable"]:
        parts.append(f"unstable {row['num_unstable']}/{n}")
    if row["num_collapsed"]:
        parts.append(f"collapsed {row['num_collapsed']}/{n}")
    return ", ".join(parts) + f" [{', '.join(row['reasons'])}]"


def markdown_table(rows: Sequence[dict], k: int, base: dict | None = None,
                   policy_losses: bool = False) -> str:
    """The results table; ``base`` = {"eval": ..., "ood": ...} adds the base model's row.
    ``policy_losses`` adds the policy loss with its clip range (clip_low / clip_high) and the
    final training reward (mean of the last 5 steps' ``reward/mean``) as columns."""
    lead = "| regime | policy loss (clip low/high) " if policy_losses else "| regime "
    reward = "final train reward | " if policy_losses else ""
    columns = 10 if policy_losses else 8
    lines = [f"{lead}| config | beta | seeds | {reward}in-domain mean@{k} | OOD mean@{k} | "
             f"final KL (k1/token) | verdict |", "|" + "---|" * columns]
    if base is not None:
        lines.append(f"| - | {'- | ' if policy_losses else ''}base model | - | - | "
                     f"{'- | ' if policy_losses else ''}{base['eval']:.3f} | {base['ood']:.3f} "
                     "| 0 | - |")
    for r in rows:
        beta = "-" if r["config"] == "none" else f"{r['beta']:g}"
        loss = r.get("policy_loss", DEFAULT_POLICY_LOSS)
        low, high = clip_range(loss)
        lead = (f"| {r['regime']} | {loss} ({low:g}/{high:g}) " if policy_losses
                else f"| {r['regime']} ")
        reward = f"{format_mean_std(r['reward_final'])} | " if policy_losses else ""
        lines.append(f"{lead}| {r['config']} | {beta} | {r['num_seeds']} | {reward}"
                     f"{format_mean_std(r['eval_mean_at_k'])} | "
                     f"{format_mean_std(r['ood_mean_at_k'])} | "
                     f"{format_mean_std(r['kl_k1_final'], 4)} | {stability_cell(r)} |")
    return "\n".join(lines)


def mean_curve(runs: Sequence[Sequence[dict]], key: str) -> list[tuple[int, float]]:
    """Step-wise mean of ``key`` over runs (steps present in every run that has the key)."""
    per_run = [dict(_series(rows, key)) for rows in runs]
    per_run = [d for d in per_run if d]
    if not per_run:
        return []
    steps = sorted(set.intersection(*(set(d) for d in per_run)))
    return [(s, statistics.fmean(d[s] for d in per_run)) for s in steps]
