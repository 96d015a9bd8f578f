"""Small state objects of the PPO loop, each serialisable (state_dict / load_state_dict) for resume."""

from __future__ import annotations

import math

import torch


class FixedKLController:
    """beta stays where it was set."""

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019, sec. 2.2: proportional control of beta towards a target KL.

    e_t = clip(KL_t / KL_target - 1, -0.2, 0.2);  beta_{t+1} = beta_t * (1 + K_beta * e_t),
    with K_beta = min(n_steps / horizon, 1) (n_steps = episodes in this update). The cap is align's: with a horizon
    under a fifth of an update's episodes the rule as written takes beta through zero (K_beta * e_t < -1), and a
    negative beta rewards moving away from the reference; capped, beta moves by at most 20% an update.
    """

    def __init__(self, value: float, target: float, horizon: int):
        super().__init__(value)
        self.target, self.horizon = float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):  # a NaN made beta NaN: beta stays (the iteration's metrics show the NaN)
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * min(n_steps / self.horizon, 1.0)


class PIKLController(FixedKLController):
    """beta = coef + lambda, where lambda >= 0 is the Lagrange multiplier of the constraint KL <= target, set each
    iteration by the PID Lagrangian rule of Stooke, Achiam and Abbeel 2020 ("Responsive Safety in Reinforcement
    Learning by PID Lagrangian Methods", Algorithm 2) without its derivative term:

        e_t = KL_t - target                      (nats per response)
        I_t = max(0, I_{t-1} + clip(e_t, -target, target))   (held at 0 while KL stays under target)
        lambda_t = max(0, K_P * e_t + K_I * I_t)
        beta_{t+1} = coef + lambda_t

    Its horizon is in iterations, not episodes: one iteration over target by 1 nat adds K_P + K_I to beta at once,
    where Ziegler's rule moves beta by at most 20% x episodes / horizon. Under target the penalty returns to coef
    (the integral unwinds first), never below it. The clip is align's anti-windup: KL is never negative, so the
    integral unwinds by at most `target` nats an iteration, and in Stooke et al.'s rule (bounded below only) one
    held-out reading far over target (a degenerate response: 30 nats against a target of 4) wound it up by 26 and
    held beta up for 13 iterations after it; clipped, it winds as fast as it can unwind (that reading: beta back at
    coef two iterations later at 2 nats). A KL that is not finite leaves beta as it was (both controllers)."""

    def __init__(self, value: float, target: float, kp: float, ki: float):
        super().__init__(value)
        self.coef, self.target, self.kp, self.ki = float(value), float(target), float(kp), float(ki)
        self.integral = 0.0

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):  # max(0, nan) is 0: a NaN reset the integral and beta to coef, silently
            return
        error = current_kl - self.target
        self.integral = max(0.0, self.integral + min(max(error, -self.target), self.target))  # clipped: anti-windup
        self.value = self.coef + max(0.0, self.kp * error + self.ki * self.integral)

    def state_dict(self) -> dict:
        return {"value": self.value, "integral": self.integral}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.integral = float(state["value"]), float(state.get("integral", 0.0))


class RunningMoments:
    """Running mean and std of every score seen (Chan et al.'s parallel update), for reward normalisation."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> None:
        xs = xs.detach().double().flatten()
        n = xs.numel()
        if n == 0:
            return
        batch_mean, batch_var = xs.mean().item(), xs.var(unbiased=False).item()
        delta = batch_mean - self.mean
        total = self.count + n
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 1e-12))

    def normalise(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores less the running mean, over the running std while the scores seen vary (RewardScale.fit's rule:
        a std below FLAT_SCORES of max(1, |mean|) only centres them; dividing by it turned a scorer's 1e-5 noise
        into rewards of 1 to 5, which PPO then optimised)."""
        return (scores - self.mean) / (self.std if spread(self.std, self.mean) else 1.0)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


class PromptStream:
    """Position in a seeded, per-epoch shuffled prompt list: where the data loader resumes."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.index = n, seed, 0, 0

    def _order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            order = self._order()
            take = min(k - len(out), self.n - self.index)
            out += order[self.index:self.index + take]
            self.index += take
            if self.index == self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


FLAT_SCORES = 1e-4


def spread(std: float, mean: float) -> bool:
    """Whether scores of this `std` and `mean` vary enough to be scaled by 1 / std: std at least FLAT_SCORES of
    max(1, |mean|) (False for a NaN spread too)."""
    return std >= FLAT_SCORES * max(1.0, abs(mean))


class RewardScale:
    """Ziegler et al. 2019, sec. 2.2: a gain and bias fixed once, before training, so the initial policy's scores
    have mean 0 and std 1: normalised = gain * score + bias, gain = 1 / std, bias = -mean / std. Unlike running
    statistics it never drifts, so the value model (read through the same affine map) keeps its units."""

    def __init__(self):
        self.gain, self.bias, self.fitted = 1.0, 0.0, False

    def fit(self, scores: torch.Tensor) -> bool:
        """Fix the gain and bias; False when the scores barely vary (std below 1e-4 of max(1, |mean|): a judge that
        scores every initial response alike), where 1/std would multiply the first differences by up to a million:
        then the scores are only centred (gain 1)."""
        xs = scores.detach().double().flatten()
        mean, std = xs.mean().item(), xs.std(unbiased=False).item()
        scaled = spread(std, mean)
        gain = 1.0 / std if scaled else 1.0
        self.gain, self.bias, self.fitted = gain, -mean * gain, True
        return scaled

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return scores * self.gain + self.bias

    def state_dict(self) -> dict:
        return {"gain": self.gain, "bias": self.bias, "fitted": self.fitted}

    def load_state_dict(self, state: dict) -> None:
        self.gain, self.bias, self.fitted = state["gain"], state["bias"], state["fitted"]
