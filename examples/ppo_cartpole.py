"""PPO on CartPole-v1 with envfleet, in one file (after CleanRL's ``ppo.py``).

The 8 envs run in envfleet worker processes behind a ``gymnasium.vector.VectorEnv``; everything
else is a plain PyTorch PPO, with RL Baselines3 Zoo's CartPole hyperparameters (rollouts of 32
steps per env, 20 epochs, learning rate 1e-3 annealed, gamma 0.98, GAE lambda 0.8). It reaches a
mean return of 475 over 20 episodes in about 30-40k steps (well under a minute on two cores).
The learning curve is printed as training goes and saved as a PNG in ``--out-dir`` (``runs/``).

    python examples/ppo_cartpole.py                      # until the last 20 episodes average 475
    python examples/ppo_cartpole.py --total-timesteps 4096 --out-dir runs/short

The last line printed is a JSON summary (``summary: {...}``).

Autoreset: the pool uses Gymnasium's ``SAME_STEP`` mode, so the observation after an episode
ends is already the next episode's first one and every stored transition is a real one; a
truncated episode (CartPole's 500-step limit) is bootstrapped from ``infos["final_obs"]``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import random
import time
from collections import deque
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
    env_id: str = "CartPole-v1"
    """the Gymnasium id of the environment"""
    seed: int = 1
    """seed of the experiment (envs, torch, numpy)"""
    total_timesteps: int = 200_000
    """the most environment steps to train for"""
    target_return: float = 475.0
    """stop once the mean return of the last `window` episodes reaches this"""
    window: int = 20
    """episodes averaged for the learning curve and the stopping test"""
    num_envs: int = 8
    """parallel envs"""
    backend: str = "process"
    """envfleet backend: process, thread or serial"""
    num_workers: int | None = None
    """envfleet worker processes (default: usable cores)"""
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
    """torch CPU threads (the env workers use the other cores)"""
    out_dir: str = "runs"
    """folder for what the run writes (made if missing): the learning curve, ppo_cartpole.png"""
    plot: str | None = None
    """where to save the learning curve (PNG) instead (default: OUT_DIR/ppo_cartpole.png)"""


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


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, n_actions), std=0.01),
        )

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)  # type: ignore[no-any-return]

    def get_action_and_value(
        self, x: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def output_path(path: str | None, out_dir: str, name: str) -> Path:
    """``path`` if given, else ``out_dir/name``; its folder is made if missing."""
    target = Path(path) if path else Path(out_dir) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def save_curve(path: str, steps: list[int], returns: list[float], args: Args) -> None:
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
    ax.set_title(f"PPO on {args.env_id} ({args.num_envs} envfleet envs, {args.backend})")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = max(1, args.total_timesteps // batch_size)

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)

    envs = envfleet.make(
        args.env_id,
        args.num_envs,
        backend=args.backend,
        num_workers=args.num_workers,
        seed=args.seed,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "discrete actions only"
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    agent = Agent(obs_dim, int(envs.single_action_space.n))
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    obs = torch.zeros((args.num_steps, args.num_envs, obs_dim))
    actions = torch.zeros((args.num_steps, args.num_envs), dtype=torch.long)
    logprobs = torch.zeros((args.num_steps, args.num_envs))
    rewards = torch.zeros((args.num_steps, args.num_envs))
    dones = torch.zeros((args.num_steps, args.num_envs))
    values = torch.zeros((args.num_steps, args.num_envs))

    global_step = 0
    start_time = time.time()
    episode_steps: list[int] = []
    episode_returns: list[float] = []
    recent: deque[float] = deque(maxlen=args.window)
    solved_at: int | None = None
    next_obs = torch.as_tensor(envs.reset(seed=args.seed)[0], dtype=torch.float32)
    next_done = torch.zeros(args.num_envs)

    try:
        for iteration in range(1, num_iterations + 1):
            optimizer.param_groups[0]["lr"] = args.learning_rate * (
                1.0 - (iteration - 1.0) / num_iterations
            )
            for step in range(args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                dones[step] = next_done
                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
                actions[step] = action
                logprobs[step] = logprob

                obs_np, reward, terminations, truncations, infos = envs.step(action.numpy())
                reward = reward.astype(np.float32)
                # A truncated episode would have gone on: bootstrap from its final observation.
                for i in np.flatnonzero(truncations & ~terminations):
                    final = torch.as_tensor(infos["final_obs"][i], dtype=torch.float32)
                    with torch.no_grad():
                        reward[i] += args.gamma * agent.get_value(final).item()
                rewards[step] = torch.as_tensor(reward)
                next_obs = torch.as_tensor(obs_np, dtype=torch.float32)
                next_done = torch.as_tensor(terminations | truncations, dtype=torch.float32)
                if "episode" in infos:
                    for i in np.flatnonzero(infos["_episode"]):
                        episode_returns.append(float(infos["episode"]["r"][i]))
                        episode_steps.append(global_step)
                        recent.append(episode_returns[-1])

            # Generalized advantage estimation.
            with torch.no_grad():
                next_value = agent.get_value(next_obs).reshape(1, -1)
                advantages = torch.zeros_like(rewards)
                lastgaelam = torch.zeros(args.num_envs)
                for t in reversed(range(args.num_steps)):
                    if t == args.num_steps - 1:
                        nextnonterminal = 1.0 - next_done
                        nextvalues = next_value
                    else:
                        nextnonterminal = 1.0 - dones[t + 1]
                        nextvalues = values[t + 1]
                    delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                    lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                    advantages[t] = lastgaelam
                returns = advantages + values

            b_obs = obs.reshape((-1, obs_dim))
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape(-1)
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values.reshape(-1)

            b_inds = np.arange(batch_size)
            for _epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for start in range(0, batch_size, minibatch_size):
                    mb_inds = b_inds[start : start + minibatch_size]
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                        b_obs[mb_inds], b_actions[mb_inds]
                    )
                    ratio = (newlogprob - b_logprobs[mb_inds]).exp()
                    mb_advantages = b_advantages[mb_inds]
                    mb_advantages = (mb_advantages - mb_advantages.mean()) / (
                        mb_advantages.std() + 1e-8
                    )
                    pg_loss = torch.max(
                        -mb_advantages * ratio,
                        -mb_advantages * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef),
                    ).mean()
                    newvalue = newvalue.view(-1)
                    v_clipped = b_values[mb_inds] + torch.clamp(
                        newvalue - b_values[mb_inds], -args.clip_coef, args.clip_coef
                    )
                    v_loss = (
                        0.5
                        * torch.max(
                            (newvalue - b_returns[mb_inds]) ** 2,
                            (v_clipped - b_returns[mb_inds]) ** 2,
                        ).mean()
                    )
                    loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()

            mean_return = float(np.mean(recent)) if recent else float("nan")
            sps = int(global_step / (time.time() - start_time))
            print(
                f"iteration={iteration}/{num_iterations} global_step={global_step} "
                f"episodes={len(episode_returns)} mean_return_last_{args.window}={mean_return:.1f} "
                f"sps={sps}",
                flush=True,
            )
            if len(recent) == args.window and mean_return >= args.target_return:
                solved_at = global_step
                break
    finally:
        envs.close()

    plot = output_path(args.plot, args.out_dir, "ppo_cartpole.png")
    save_curve(str(plot), episode_steps, episode_returns, args)
    summary = {
        "env_id": args.env_id,
        "global_step": global_step,
        "episodes": len(episode_returns),
        f"mean_return_last_{args.window}": float(np.mean(recent)) if recent else None,
        "best_return": max(episode_returns, default=None),
        "solved_at": solved_at,
        "seconds": round(time.time() - start_time, 1),
        "plot": str(plot),
    }
    print("summary: " + json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
