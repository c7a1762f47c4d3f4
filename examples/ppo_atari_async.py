"""PPO on Atari Pong with double-buffered rollouts, in one file (after CleanRL's ``ppo_atari.py``).

The policy's forward pass sits between every result and the next action. With envfleet's async
mode the 16 envs are split in two batches (``batch_size = num_envs / 2``): while the policy
picks actions for one half, the other half steps in the worker processes, so inference and
emulation overlap instead of taking turns. Everything else is CleanRL's PPO for Atari:
Gymnasium's standard preprocessing (``AtariPreprocessing``: 84x84 grey, frame skip 4, up to 30
no-ops; 4 frames stacked), the Nature-DQN network, GAE, the clipped objective.

    python examples/ppo_atari_async.py                              # ~3 minutes on 2 cores
    python examples/ppo_atari_async.py --async-batches 1            # envfleet, synchronous
    python examples/ppo_atari_async.py --env-backend gymnasium      # gymnasium AsyncVectorEnv
    python examples/ppo_atari_async.py --total-timesteps 10000000   # a real run (learns Pong)
    python examples/ppo_atari_async.py --backend ray --address auto # on a Ray cluster

Each iteration prints the rollout speed (env steps per second of collection, inference
included) and the episodes' returns; the learning curve and the rollout speed are saved as a
PNG. The last line printed is a JSON summary (``summary: {...}``). The default budget only shows
the machinery: Pong needs millions of steps before the returns rise above -21.

How the rollout is stored. An async ``recv`` hands back whichever envs are ready, so instead of
a ``[step, env]`` grid the rollout is a list of *records* (one per action taken: observation,
action, log-probability, value, env id); the reward and "done" of a record arrive with that
env's next ``recv``. At the end of an iteration every env has one action in flight: its record
bootstraps the value of the env's last complete one and is carried into the next iteration
(one transition per env per iteration is thus sampled by the previous policy; PPO's ratio uses
its recorded log-probability). GAE runs per env over its records in order. The pool resets an
env in the step that ends its episode (``SAME_STEP``), so every record is a real transition;
truncation (108,000 frames) is treated as the episode's end.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

import envfleet


@dataclasses.dataclass
class Args:
    env_id: str = "ALE/Pong-v5"
    """the Atari game (built with frameskip=1; AtariPreprocessing skips 4)"""
    seed: int = 1
    """seed of the experiment (envs, torch, numpy)"""
    total_timesteps: int = 16_384
    """environment steps to train for (agent steps: 4 frames each)"""
    num_envs: int = 16
    """parallel envs"""
    env_backend: str = "envfleet"
    """who steps the envs: envfleet (process backend) or gymnasium (AsyncVectorEnv)"""
    async_batches: int = 2
    """envfleet: batches the envs are split in (2: double buffering; 1: synchronous)"""
    num_workers: int | None = None
    """envfleet worker processes (default: usable cores; on a cluster, in all)"""
    backend: str = "process"
    """envfleet backend: process (this machine) or ray (a Ray cluster: see --address)"""
    address: str | None = None
    """ray backend: the cluster to join ("auto" on one of its nodes); default: a local Ray"""
    learning_rate: float = 2.5e-4
    """the optimizer's learning rate (annealed to 0)"""
    num_steps: int = 128
    """actions per env per rollout"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalized advantage estimation"""
    num_minibatches: int = 4
    """minibatches per epoch"""
    update_epochs: int = 4
    """epochs per rollout"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient"""
    ent_coef: float = 0.01
    """coefficient of the entropy bonus"""
    vf_coef: float = 0.5
    """coefficient of the value loss"""
    max_grad_norm: float = 0.5
    """gradient clipping norm"""
    rollout_threads: int = 1
    """torch CPU threads while collecting (the env workers use the other cores)"""
    update_threads: int = 0
    """torch CPU threads for the update, when the envs are idle (0: every core)"""
    out_dir: str = "runs"
    """folder for what the run writes (made if missing): the plot, ppo_atari_async.png"""
    plot: str | None = None
    """where to save the learning curve and rollout speed (PNG) instead (default:
    OUT_DIR/ppo_atari_async.png)"""


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
        doc = docs[f.name]
        if f.default is not None and "default" not in doc:
            doc += f" (default: {f.default})"
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default, help=doc)
    return Args(**vars(parser.parse_args(argv)))


def make_env(env_id: str) -> gym.Env[Any, Any]:
    """One Atari env with Gymnasium's standard preprocessing: obs ``uint8 (4, 84, 84)``."""
    import ale_py

    gym.register_envs(ale_py)
    env = gym.make(env_id, frameskip=1)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30)
    return gym.wrappers.FrameStackObservation(env, 4)


class Envs:
    """The envs behind ``send(actions, env_ids)`` / ``recv() -> (obs, rewards, dones, env_ids)``.

    envfleet's pool hands back the first ``num_envs / async_batches`` envs ready; Gymnasium's
    ``AsyncVectorEnv`` steps all envs at once (``step_async`` / ``step_wait``).
    """

    def __init__(self, args: Args) -> None:
        self.num_envs = args.num_envs
        self._stepping = False
        same_step = gym.vector.AutoresetMode.SAME_STEP
        factory = _Factory(args.env_id)
        if args.env_backend == "envfleet":
            self.pool: Any = envfleet.make(
                factory,
                args.num_envs,
                backend=args.backend,
                num_workers=args.num_workers,
                **({} if args.address is None else {"address": args.address}),
                batch_size=args.num_envs // args.async_batches,
                seed=args.seed,
                autoreset_mode=same_step,
                # A batch that is one worker's block of envs comes as a view of the pool's
                # shared memory: torch.from_numpy takes it with no copy (store it before send).
                copy=False,
            )
            self.pool.async_reset(seed=args.seed)
        elif args.env_backend == "gymnasium":
            self.pool = gym.vector.AsyncVectorEnv(
                [factory] * args.num_envs, shared_memory=True, autoreset_mode=same_step
            )
            self._first = self.pool.reset(seed=args.seed)[0]
        else:
            raise ValueError(f"--env-backend: envfleet or gymnasium, not {args.env_backend!r}")
        self.single_action_space = self.pool.single_action_space

    def send(self, actions: np.ndarray, env_ids: np.ndarray) -> None:
        if isinstance(self.pool, envfleet.Pool):
            self.pool.send(actions, env_ids)
        else:
            self.pool.step_async(actions)
            self._stepping = True

    def recv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if isinstance(self.pool, envfleet.Pool):
            obs, rewards, terminations, truncations, infos = self.pool.recv()
            env_ids = infos["env_id"]
        elif self._first is not None:  # the reset's observations, with no reward yet
            obs, self._first = self._first, None
            rewards = terminations = truncations = np.zeros(self.num_envs)
            env_ids = np.arange(self.num_envs)
        else:
            obs, rewards, terminations, truncations, _ = self.pool.step_wait()
            self._stepping = False
            env_ids = np.arange(self.num_envs)
        return obs, rewards, np.logical_or(terminations, truncations), env_ids

    def close(self) -> None:
        if self._stepping:  # Gymnasium's last step_async: wait for it, as close() would warn
            self.pool.step_wait()
        self.pool.close()


class _Factory:
    """A picklable zero-argument factory for the worker processes."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id

    def __call__(self) -> gym.Env[Any, Any]:
        return make_env(self.env_id)


def layer_init(layer: Any, std: float = np.sqrt(2), bias_const: float = 0.0) -> Any:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, n_actions: int) -> None:
        super().__init__()
        self.network = nn.Sequential(  # Nature DQN: (4, 84, 84) -> 512
            layer_init(nn.Conv2d(4, 32, 8, stride=4)),
            nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)),
            nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def get_action_and_value(
        self, x: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.network(x.float() / 255.0)
        probs = Categorical(logits=self.actor(hidden))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden).flatten()


def gae(
    env: np.ndarray,
    rewards: np.ndarray,
    dones: np.ndarray,
    values: np.ndarray,
    complete: np.ndarray,
    pending: np.ndarray,
    gamma: float,
    lam: float,
) -> np.ndarray:
    """Advantages of the complete records, per env in record order; ``pending[e]`` is env
    ``e``'s record still in flight, whose value bootstraps the env's last complete one."""
    advantages = np.zeros_like(values)
    for e, last in enumerate(pending):
        next_value, running = values[last], 0.0
        for i in np.flatnonzero((env == e) & complete)[::-1]:
            nonterminal = 1.0 - dones[i]
            delta = rewards[i] + gamma * next_value * nonterminal - values[i]
            running = delta + gamma * lam * nonterminal * running
            advantages[i], next_value = running, values[i]
    return advantages


def save_curve(
    path: str, episodes: list[tuple[int, float]], speeds: list[float], args: Args
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.scatter([s for s, _ in episodes], [r for _, r in episodes], s=8, label="episode return")
    left.set_xlabel("environment steps")
    left.set_ylabel("return")
    left.set_title(f"PPO on {args.env_id}")
    right.plot(range(1, len(speeds) + 1), speeds, marker="o")
    right.set_ylim(bottom=0)
    right.set_xlabel("iteration")
    right.set_ylabel("env steps / s while collecting")
    mode = f"{args.async_batches} batches" if args.env_backend == "envfleet" else "sync"
    right.set_title(f"rollout speed ({args.num_envs} envs, {args.env_backend}, {mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.env_backend == "gymnasium":
        args.async_batches = 1
    if args.num_envs % args.async_batches:
        raise SystemExit("--num-envs must be a multiple of --async-batches")
    decisions = args.num_envs * args.num_steps  # actions taken per iteration
    num_iterations = max(1, args.total_timesteps // decisions)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    update_threads = args.update_threads or torch.get_num_threads()
    print(f"torch threads: {args.rollout_threads} collecting, {update_threads} updating")

    envs = Envs(args)
    agent = Agent(int(envs.single_action_space.n))
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    # One record per action: capacity for an iteration's actions plus the carried ones.
    capacity = decisions + args.num_envs
    obs = torch.zeros((capacity, 4, 84, 84), dtype=torch.uint8)
    actions = torch.zeros(capacity, dtype=torch.long)
    logprobs = torch.zeros(capacity)
    values = np.zeros(capacity, dtype=np.float32)
    env = np.zeros(capacity, dtype=np.int64)
    rewards = np.zeros(capacity, dtype=np.float32)
    dones = np.zeros(capacity, dtype=np.float32)
    complete = np.zeros(capacity, dtype=np.bool_)
    pending = np.full(args.num_envs, -1)  # each env's record in flight (-1: none yet)

    global_step = 0
    start_time = time.time()
    episode_return = np.zeros(args.num_envs)
    episodes: list[tuple[int, float]] = []
    speeds: list[float] = []
    trained: list[int] = []

    try:
        for iteration in range(1, num_iterations + 1):
            optimizer.param_groups[0]["lr"] = args.learning_rate * (
                1.0 - (iteration - 1.0) / num_iterations
            )
            # Carry each env's record in flight to the front; its result comes in this rollout.
            n = 0
            if iteration > 1:
                carried = torch.from_numpy(pending.copy())  # env e's record moves to row e
                obs[: args.num_envs], actions[: args.num_envs] = obs[carried], actions[carried]
                logprobs[: args.num_envs] = logprobs[carried]
                values[: args.num_envs], env[: args.num_envs] = values[pending], env[pending]
                pending[:] = np.arange(args.num_envs)
                n = args.num_envs
            complete[:] = False

            torch.set_num_threads(args.rollout_threads)
            collect_start = time.perf_counter()
            taken = 0
            while taken < decisions:
                next_obs, reward, done, ids = envs.recv()
                # These results complete each env's record in flight.
                last = pending[ids]
                has = last >= 0
                rewards[last[has]], dones[last[has]] = reward[has], done[has]
                complete[last[has]] = True
                episode_return[ids] += reward
                for e in ids[done.astype(bool)]:
                    episodes.append((global_step, float(episode_return[e])))
                    episode_return[e] = 0.0

                with torch.no_grad():
                    x = torch.from_numpy(next_obs)  # no copy: the pool's memory (copy=False)
                    action, logprob, _, value = agent.get_action_and_value(x)
                rows = slice(n, n + len(ids))
                # Stored before send(): the envs then write their next observations over x.
                obs[rows], actions[rows], logprobs[rows] = x, action, logprob
                values[rows], env[rows] = value.numpy(), ids
                envs.send(action.numpy(), ids)
                pending[ids] = np.arange(n, n + len(ids))
                n += len(ids)
                taken += len(ids)
                global_step += len(ids)
            speeds.append(taken / (time.perf_counter() - collect_start))

            advantages = gae(
                env[:n], rewards[:n], dones[:n], values[:n], complete[:n], pending,
                args.gamma, args.gae_lambda,
            )  # fmt: skip
            returns = torch.from_numpy(advantages + values[:n])
            b_inds = np.flatnonzero(complete[:n])
            trained.append(len(b_inds))
            b_advantages = torch.from_numpy(advantages)
            b_values = torch.from_numpy(values[:n])

            torch.set_num_threads(update_threads)  # the envs are idle now
            minibatch_size = max(1, len(b_inds) // args.num_minibatches)
            for _epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for begin in range(0, len(b_inds), minibatch_size):
                    mb = torch.from_numpy(b_inds[begin : begin + minibatch_size])
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                        obs[mb], actions[mb]
                    )
                    ratio = (newlogprob - logprobs[mb]).exp()
                    mb_adv = b_advantages[mb]
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                    pg_loss = torch.max(
                        -mb_adv * ratio,
                        -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef),
                    ).mean()
                    v_clipped = b_values[mb] + torch.clamp(
                        newvalue - b_values[mb], -args.clip_coef, args.clip_coef
                    )
                    v_loss = (
                        0.5
                        * torch.max(
                            (newvalue - returns[mb]) ** 2, (v_clipped - returns[mb]) ** 2
                        ).mean()
                    )
                    loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()

            recent = [r for _, r in episodes[-10:]]
            print(
                f"iteration={iteration}/{num_iterations} global_step={global_step} "
                f"trained={len(b_inds)} rollout_sps={speeds[-1]:.0f} episodes={len(episodes)} "
                f"mean_return_last_10={statistics.fmean(recent) if recent else float('nan'):.1f}",
                flush=True,
            )
    finally:
        envs.close()

    plot = Path(args.plot) if args.plot else Path(args.out_dir) / "ppo_atari_async.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    save_curve(str(plot), episodes, speeds, args)
    summary = {
        "env_id": args.env_id,
        "env_backend": args.env_backend,
        "async_batches": args.async_batches,
        "num_envs": args.num_envs,
        "global_step": global_step,
        "trained_per_iteration": trained,
        "rollout_sps": round(statistics.median(speeds)),
        "episodes": len(episodes),
        "mean_return_last_10": statistics.fmean(r for _, r in episodes[-10:]) if episodes else None,
        "seconds": round(time.time() - start_time, 1),
        "plot": str(plot),
    }
    print("summary: " + json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
