"""PPO on CartPole-v1 with the policy acting on the workers, the learner one version behind.

The same PPO as ``examples/ppo_cartpole.py`` (after CleanRL's ``ppo.py``, RL Baselines3 Zoo's
CartPole hyperparameters), with the actor wrapped in an ``envfleet.TorchPolicy``. Collector
``rollouts`` (the default): the workers run the actor and step their envs 32 times per rollout
(``pool.rollout_async``), and the driver learns on rollout k while the pool collects rollout
k + 1 with the weights it had before that update::

    rollout_async(k + 1, version v)  ──  the workers act with version v
    learn on rollout k (acted by v - 1 or v)  ──►  version v + 1
    rollout_wait() = rollout k + 1; rollout_async(k + 2, version v + 1); learn on k + 1 ...

so every update but the first learns from actions of the version before the learner's. The
version that acted keeps its actor's weights until its rollout comes back, and the behaviour
log-probabilities are computed again on the driver with them. PPO's clipped ratio is the new
policy's probability of each action over the acting version's (``--ratio behaviour``;
already off 1 before the update). ``--ratio decoupled`` (the default: "decoupled PPO", Hilton
et al. 2021, *Batch size-invariance for policy optimization*) clips around the learner's
weights at the start of the update instead, as PPO on fresh data does, and weights each sample
by the learner's probability of its action over the acting version's. The values (GAE, the value
loss's clipping, the bootstrap of truncated episodes) come from the learner's current critic
at the start of the update: the critic is no part of the behaviour (the ratio corrects for the
actor only), it never runs on the workers, and the newest one is the best estimate there is;
on fresh data that is exactly what ``ppo_cartpole.py`` does.

Env steps to a mean return of 475 over 20 episodes, seeds 1 to 13 (mean, min-max): ``sync``
40.9k (28.2k-52.5k), ``rollouts`` 42.7k (29.4k-59.4k, 1.04x sync), ``rollouts --ratio
behaviour`` 40.6k (29.2k-54.3k, 0.99x): the lag of one version costs no samples here. Three
seeds are too few to tell: PPO's own spread between seeds (sync: 28k-52k) moves the ratio of
any three (1-3, 4-6, 7-9, 10-12) between 0.89x and 1.26x (``behaviour``: 0.73x-1.26x); seeds
1-3 give 1.16x (``behaviour``: 1.26x).

Collector ``sync``: the same PPO on ``gymnasium.vector.SyncVectorEnv``, the actor acting on the
driver with the current weights (no lag): the baseline. ``--address`` runs the envs and the
policy on a Ray cluster (``backend="ray"``: one sub-pool per node on a cluster of several).

    python examples/ppo_rollouts.py                       # until the last 20 episodes average 475
    python examples/ppo_rollouts.py --collector sync      # the baseline
    python examples/ppo_rollouts.py --address auto        # on the Ray cluster of this machine

The last line printed is a JSON summary (``summary: {...}``): ``solved_at`` is the env steps
taken until the mean return of the last 20 episodes reached 475 (``null``: not within
``--total-timesteps``), and ``policy_lags`` counts the updates by how many versions the actions
they learned from were behind the learner's.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import json
import random
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

import envfleet


@dataclasses.dataclass
class Args:
    env_id: str = "CartPole-v1"
    """the Gymnasium id of the environment"""
    seed: int = 1
    """seed of the experiment (envs, actions, torch, numpy)"""
    collector: str = "rollouts"
    """rollouts (the workers act, the learner one version behind) or sync (SyncVectorEnv)"""
    ratio: str = "decoupled"
    """behaviour (clip around the version that acted) or decoupled (around the learner's)"""
    total_timesteps: int = 200_000
    """the most environment steps to train for"""
    target_return: float = 475.0
    """stop once the mean return of the last `window` episodes reaches this"""
    window: int = 20
    """episodes averaged for the learning curve and the stopping test"""
    num_envs: int = 8
    """parallel envs"""
    backend: str = "process"
    """envfleet backend of the rollouts collector: process, thread, serial or ray"""
    num_workers: int | None = None
    """envfleet workers (default: usable cores of this machine; on a cluster, say how many)"""
    address: str | None = None
    """a Ray cluster's address (auto, host:port, ray://host:port): the ray backend there"""
    learning_rate: float = 1e-3
    """the optimizer's learning rate (annealed to 0)"""
    num_steps: int = 32
    """steps per env per rollout"""
    gamma: float = 0.98
    """discount factor"""
    gae_lambda: float = 0.8
    """lambda of generalized advantage estimation"""
    num_minibatches: int = 1
    """minibatches per epoch"""
    update_epochs: int = 20
    """epochs per rollout"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient"""
    ent_coef: float = 0.0
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """gradient clipping norm"""
    torch_threads: int = 1
    """torch CPU threads of the learner (each worker's policy runs on one)"""
    out_dir: str = "runs"
    """folder for what the run writes (made if missing): the learning curve, ppo_rollouts.png"""
    plot: str | None = None
    """where to save the learning curve (PNG) instead (default: OUT_DIR/ppo_rollouts.png)"""


def field_docs() -> dict[str, str]:
    """Each field of ``Args`` and the docstring under it (the flag's help)."""
    docs: dict[str, str] = {}
    for node in ast.parse(Path(__file__).read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "Args":
            for field, doc in zip(node.body, node.body[1:], strict=False):
                if (
                    isinstance(field, ast.AnnAssign)
                    and isinstance(field.target, ast.Name)
                    and isinstance(doc, ast.Expr)
                    and isinstance(doc.value, ast.Constant)
                ):
                    docs[field.target.id] = " ".join(str(doc.value.value).split())
    return docs


def parse_args(argv: list[str] | None = None) -> Args:
    """``Args`` from the command line; each flag's help is its field's docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    docs = field_docs()
    for f in dataclasses.fields(Args):
        kind: Any = {"int": int, "float": float, "str": str}.get(str(f.type).split(" |")[0], str)
        doc = docs[f.name] + ("" if f.default is None else f" (default: {f.default})")
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default, help=doc)
    args = Args(**vars(parser.parse_args(argv)))
    if args.collector not in ("rollouts", "sync"):
        parser.error(f"--collector must be rollouts or sync, got {args.collector!r}")
    if args.ratio not in ("decoupled", "behaviour"):
        parser.error(f"--ratio must be decoupled or behaviour, got {args.ratio!r}")
    return args


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mlp(obs_dim: int, out: int, std: float) -> nn.Sequential:
    """The actor (logits) or the critic (a value) of ``ppo_cartpole.py``'s agent."""
    return nn.Sequential(
        layer_init(nn.Linear(obs_dim, 64)),
        nn.Tanh(),
        layer_init(nn.Linear(64, 64)),
        nn.Tanh(),
        layer_init(nn.Linear(64, out), std=std),
    )


@dataclasses.dataclass
class Batch:
    """One rollout: ``num_steps`` steps of every env, and the version that acted."""

    obs: np.ndarray  # (T, N, obs_dim): what the policy saw
    actions: np.ndarray  # (T, N)
    rewards: np.ndarray  # (T, N)
    dones: np.ndarray  # (T, N): the episode ended at that step (terminated or truncated)
    truncated: list[tuple[int, int, np.ndarray]]  # (t, env, final observation): to bootstrap
    next_obs: np.ndarray  # (N, obs_dim): after the last step
    version: int  # the version of the actor's weights that acted
    weights: dict[str, np.ndarray]  # those weights


def truncations(infos: dict[str, Any], terminated: np.ndarray, truncated: np.ndarray) -> list[Any]:
    """The envs whose episode was cut (not ended) at this step, with their final observation
    (SAME_STEP autoreset: ``infos["final_obs"]``)."""
    return [(i, infos["final_obs"][i]) for i in np.flatnonzero(truncated & ~terminated)]


class Rollouts:
    """The workers act: one rollout out while the learner learns on the one before."""

    def __init__(self, args: Args, policy: envfleet.TorchPolicy) -> None:
        where: dict[str, Any] = {"backend": args.backend, "num_workers": args.num_workers}
        if args.address is not None:
            where = {"backend": "ray", "address": args.address, "num_workers": args.num_workers}
        self.pool = envfleet.make(
            args.env_id,
            args.num_envs,
            seed=args.seed,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
            **where,
        )
        self.pool.reset()
        self.policy, self.steps = policy, args.num_steps
        self.kept: dict[int, dict[str, np.ndarray]] = {}  # the weights of the versions out
        self.start(version=1)

    def start(self, version: int) -> None:
        """The next rollout, with the learner's weights now (``version``)."""
        self.pool.rollout_async(self.policy, self.steps, version=version)
        self.kept.setdefault(version, self.policy.weights())

    def next(self, version: int) -> Batch:
        r = self.pool.rollout_wait()
        self.start(version)  # collected while the learner learns on r
        (acted,) = set(r.policy_versions.ravel().tolist())
        weights = self.kept[acted]
        self.kept = {v: w for v, w in self.kept.items() if v > acted or v == version}
        cut = [
            (t, int(i), np.asarray(final))
            for t, infos in enumerate(r.infos)
            if "final_obs" in infos
            for i, final in truncations(infos, r.terminations[t], r.truncations[t])
        ]
        return Batch(
            r.observations,
            r.actions,
            r.rewards,
            r.terminations | r.truncations,
            cut,
            r.final_observations,
            acted,
            weights,
        )

    def close(self) -> None:
        self.pool.close()  # the rollout still out included


class Sync:
    """The baseline: ``SyncVectorEnv``, the current actor acting on the driver."""

    def __init__(self, args: Args, policy: envfleet.TorchPolicy) -> None:
        self.envs = gym.vector.SyncVectorEnv(
            [lambda: gym.make(args.env_id)] * args.num_envs,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
        self.obs, _ = self.envs.reset(seed=args.seed)
        self.policy, self.steps, self.ids = policy, args.num_steps, np.arange(args.num_envs)

    def next(self, version: int) -> Batch:
        obs, actions, rewards, dones, cut = [], [], [], [], []
        for t in range(self.steps):
            obs.append(self.obs)
            actions.append(self.policy(self.obs, self.ids))
            self.obs, reward, terminated, truncated, infos = self.envs.step(actions[-1])
            rewards.append(reward)
            dones.append(terminated | truncated)
            cut += [(t, int(i), f) for i, f in truncations(infos, terminated, truncated)]
        weights = self.policy.weights()  # the learner's: they acted
        o, a, r, d = (np.stack(x) for x in (obs, actions, rewards, dones))
        return Batch(o, a, r, d, cut, self.obs, version, weights)

    def close(self) -> None:
        self.envs.close()


def gae(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    values: torch.Tensor,
    next_value: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """Advantages over ``(T, N)`` grids; ``dones[t]``: the episode ended at step ``t``."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(next_value)
    for t in reversed(range(len(rewards))):
        following = next_value if t == len(rewards) - 1 else values[t + 1]
        nonterminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * following * nonterminal - values[t]
        running = delta + gamma * lam * nonterminal * running
        advantages[t] = running
    return advantages


def learn(
    args: Args,
    policy: envfleet.TorchPolicy,
    behaviour: envfleet.TorchPolicy,
    critic: nn.Module,
    optimizer: optim.Optimizer,
    batch: Batch,
) -> float:
    """One PPO update on ``batch``; returns the largest ``|ratio - 1|`` before it (0 when the
    version that acted is the learner's)."""
    steps, n = batch.rewards.shape
    obs = torch.as_tensor(batch.obs, dtype=torch.float32).reshape(steps * n, -1)
    actions = torch.as_tensor(batch.actions).reshape(-1)
    behaviour.load_weights(batch.weights)  # the version that acted
    with torch.no_grad():
        b_logprobs = behaviour.distribution(obs).log_prob(actions)
        prox_logprobs = policy.distribution(obs).log_prob(actions)  # the learner's, now
        lag = float((prox_logprobs - b_logprobs).exp().sub(1).abs().max())
        if args.ratio == "decoupled":  # clip around the learner's weights, reweight the data
            anchor, weight = prox_logprobs, (prox_logprobs - b_logprobs).exp()
        else:  # clip around the version that acted
            anchor, weight = b_logprobs, torch.ones_like(b_logprobs)
        values = critic(obs).reshape(steps, n)
        next_value = critic(torch.as_tensor(batch.next_obs, dtype=torch.float32)).reshape(n)
        rewards = torch.as_tensor(batch.rewards, dtype=torch.float32).clone()
        for t, i, final in batch.truncated:  # a cut episode would have gone on: bootstrap
            rewards[t, i] += args.gamma * critic(torch.as_tensor(final, dtype=torch.float32))[0]
        dones = torch.as_tensor(batch.dones, dtype=torch.float32)
        advantages = gae(rewards, dones, values, next_value, args.gamma, args.gae_lambda)
        b_returns = (advantages + values).reshape(-1)
    b_advantages, b_values = advantages.reshape(-1), values.reshape(-1)
    params = [*policy.module.parameters(), *critic.parameters()]
    size = steps * n
    minibatch = size // args.num_minibatches
    b_inds = np.arange(size)
    for _epoch in range(args.update_epochs):
        np.random.shuffle(b_inds)
        for start in range(0, size, minibatch):
            mb = b_inds[start : start + minibatch]
            dist = policy.distribution(obs[mb])
            ratio = (dist.log_prob(actions[mb]) - anchor[mb]).exp()
            mb_adv = b_advantages[mb]
            mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            clipped = torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)
            pg_loss = (weight[mb] * torch.max(-mb_adv * ratio, -mb_adv * clipped)).mean()
            newvalue = critic(obs[mb]).view(-1)
            v_clipped = b_values[mb] + torch.clamp(
                newvalue - b_values[mb], -args.clip_coef, args.clip_coef
            )
            v_loss = (
                0.5
                * torch.max(
                    (newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2
                ).mean()
            )
            loss = pg_loss - args.ent_coef * dist.entropy().mean() + v_loss * args.vf_coef
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            optimizer.step()
    return lag


def output_path(path: str | None, out_dir: str, name: str) -> Path:
    """``path`` if given, else ``out_dir/name``; its folder is made if missing."""
    target = Path(path) if path else Path(out_dir) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def save_curve(path: Path, steps: list[int], returns: list[float], args: Args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter(steps, returns, s=4, alpha=0.3, label="episode return")
    if returns:
        means = [np.mean(returns[max(0, i + 1 - args.window) : i + 1]) for i in range(len(returns))]
        ax.plot(steps, means, color="C1", label=f"mean of last {args.window}")
    ax.axhline(args.target_return, color="gray", linestyle="--", label="target")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("return")
    ax.set_title(f"PPO on {args.env_id} ({args.num_envs} envs, collector {args.collector})")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    batch_size = args.num_envs * args.num_steps
    num_iterations = max(1, args.total_timesteps // batch_size)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)

    probe = gym.make(args.env_id)
    space, obs_dim = probe.action_space, int(np.prod(probe.observation_space.shape or ()))
    probe.close()
    assert isinstance(space, gym.spaces.Discrete), "discrete actions only"
    actor, critic = mlp(obs_dim, int(space.n), 0.01), mlp(obs_dim, 1, 1.0)
    policy = envfleet.TorchPolicy(actor, space, seed=args.seed)  # env i draws seeded seed + i
    behaviour = envfleet.TorchPolicy(copy.deepcopy(actor), space)
    params = [*actor.parameters(), *critic.parameters()]
    optimizer = optim.Adam(params, lr=args.learning_rate, eps=1e-5)
    collector = (Rollouts if args.collector == "rollouts" else Sync)(args, policy)

    global_step, start_time = 0, time.time()
    episode_steps: list[int] = []
    episode_returns: list[float] = []
    running = np.zeros(args.num_envs)
    recent: deque[float] = deque(maxlen=args.window)
    lags: Counter[int] = Counter()
    ratios: list[float] = []
    solved_at: int | None = None
    nodes = 0
    try:
        for iteration in range(1, num_iterations + 1):
            version = iteration  # the learner's weights after iteration - 1 updates
            batch = collector.next(version)
            lags[version - batch.version] += 1
            for t in range(args.num_steps):
                running += batch.rewards[t]
                for i in np.flatnonzero(batch.dones[t]):
                    episode_returns.append(float(running[i]))
                    episode_steps.append(global_step + (t + 1) * args.num_envs)
                    recent.append(episode_returns[-1])
                    running[i] = 0.0
            global_step += batch_size
            optimizer.param_groups[0]["lr"] = args.learning_rate * (
                1.0 - (iteration - 1.0) / num_iterations
            )
            ratios.append(learn(args, policy, behaviour, critic, optimizer, batch))
            mean_return = float(np.mean(recent)) if recent else float("nan")
            print(
                f"iteration={iteration}/{num_iterations} global_step={global_step} "
                f"episodes={len(episode_returns)} mean_return_last_{args.window}={mean_return:.1f} "
                f"acted={batch.version} learner={version} "
                f"sps={int(global_step / (time.time() - start_time))}",
                flush=True,
            )
            if len(recent) == args.window and mean_return >= args.target_return:
                solved_at = global_step
                break
        if isinstance(collector, Rollouts):
            nodes = len(collector.pool.stats().nodes)
    finally:
        collector.close()

    plot = output_path(args.plot, args.out_dir, "ppo_rollouts.png")
    save_curve(plot, episode_steps, episode_returns, args)
    summary = {
        "env_id": args.env_id,
        "collector": args.collector,
        "ratio": args.ratio,
        "backend": "ray" if args.address else args.backend,
        "nodes": nodes,
        "seed": args.seed,
        "iterations": len(ratios),
        "global_step": global_step,
        "episodes": len(episode_returns),
        "episode_returns": episode_returns,
        f"mean_return_last_{args.window}": float(np.mean(recent)) if recent else None,
        "best_return": max(episode_returns, default=None),
        "solved_at": solved_at,
        "policy_lags": {str(k): v for k, v in sorted(lags.items())},
        "max_ratio_deviation_before_update": ratios,
        "seconds": round(time.time() - start_time, 1),
        "plot": str(plot),
    }
    print("summary: " + json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
