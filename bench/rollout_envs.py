"""Envs and policies for ``bench/rollout.py`` and ``examples/ppo_atari_async.py``'s tests.

Everything is defined at module level so that worker processes (fork, forkserver or spawn) can
import it by reference.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np

PONG = "ALE/Pong-v5"

ENVPOOL_PONG: dict[str, Any] = {
    "episodic_life": False,
    "reward_clip": False,
    "stack_num": 4,
    "img_height": 84,
    "img_width": 84,
    "frame_skip": 4,
    "noop_max": 30,
    "repeat_action_probability": 0.25,  # ALE v5's sticky actions
    "max_episode_steps": 27_000,  # 108,000 frames, as ALE v5
}
"""EnvPool's Pong configured as :func:`make_pong`: 84x84 grey, frame skip 4, 4 frames stacked,
up to 30 no-ops at reset, sticky actions, no life-loss episodes, rewards unclipped."""


def make_pong() -> gymnasium.Env[Any, Any]:
    """Pong with Gymnasium's standard Atari preprocessing: ``AtariPreprocessing`` (84x84 grey,
    frame skip 4, up to 30 no-ops) over the raw ``frameskip=1`` env, then 4 frames stacked:
    observations ``uint8 (4, 84, 84)``."""
    import ale_py

    gymnasium.register_envs(ale_py)
    env = gymnasium.make(PONG, frameskip=1)
    env = gymnasium.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30)
    return gymnasium.wrappers.FrameStackObservation(env, 4)


class TorchPolicy:
    """A PyTorch network that samples a discrete action per observation, on CPU.

    Observations go in through ``torch.from_numpy`` (no copy of float32 arrays; uint8 frames are
    scaled to [0, 1] on the way).
    """

    def __init__(self, net: Any, seed: int = 0) -> None:
        import torch

        self.net = net.eval()
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, obs: Any) -> np.ndarray:
        import torch

        with torch.inference_mode():
            x = torch.from_numpy(np.asarray(obs))
            x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
            probs = torch.softmax(self.net(x), dim=-1)
            actions = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        out: np.ndarray = actions.numpy()
        return out


def mlp(obs_dim: int, num_actions: int, hidden: int = 64) -> Any:
    """Two hidden layers of ``hidden`` with tanh (CleanRL's PPO actor)."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(obs_dim, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, num_actions),
    )


def nature_cnn(num_actions: int, frames: int = 4) -> Any:
    """The Nature-DQN network over ``(frames, 84, 84)`` inputs."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(frames, 32, 8, stride=4),
        nn.ReLU(),
        nn.Conv2d(32, 64, 4, stride=2),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 512),
        nn.ReLU(),
        nn.Linear(512, num_actions),
    )
