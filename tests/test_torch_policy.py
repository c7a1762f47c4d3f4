"""``TorchPolicy``: a PyTorch module acting on the workers.

Oracles: the actions of a rollout are those a hand-written serial sampler gives (env ``i``'s
generator seeded ``seed + i``, the module's distribution for its observation), whatever the
layout of workers; each version's weights act from the step they reach the workers, and
``Rollout.policy_versions`` says which; torch runs one thread in each worker process and the
driver's threads are left alone.
"""

from __future__ import annotations

import copy
from typing import Any

import gymnasium
import numpy as np
import pytest

pytest.importorskip("torch")
import torch
from torch import nn

import envfleet
from envfleet import TorchPolicy

SEED, POLICY_SEED, N = 0, 7, 8

LAYOUTS = [("serial", 1), ("thread", 2), ("process", 2), ("process", 4)]


def mlp(seed: int, out: int = 2, inputs: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, 16), nn.Tanh(), nn.Linear(16, out))


class Gaussian(nn.Module):
    """Means from a linear layer; the log standard deviation a parameter of its own."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.mean = nn.Linear(3, 1)
        self.log_std = nn.Parameter(torch.tensor([-0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mean(x)  # type: ignore[no-any-return]


class ThreadsSeen(nn.Module):
    """Logits that pick the action ``torch.get_num_threads()`` (Discrete(8)): the policy tells
    how many threads torch runs where it acts."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.full((len(x), 8), -1e9)
        logits[:, torch.get_num_threads()] = 0.0
        return logits


class AnyAction(gymnasium.Env[np.ndarray, np.int64]):
    """Takes any of 8 actions; its observations are zeros."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gymnasium.spaces.Discrete(8)

    def reset(
        self, *, seed: int | None = None, options: Any = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.zeros(4, np.float32), 0.0, False, False, {}


def oracle_discrete(
    module: nn.Module, observations: np.ndarray, generators: list[np.random.Generator]
) -> np.ndarray:
    """One step's actions by hand: per env, softmax probabilities, then the first action whose
    cumulative probability reaches ``1 - u`` of its generator."""
    out = []
    for i, gen in enumerate(generators):
        with torch.no_grad():
            logits = module(torch.as_tensor(observations[i : i + 1], dtype=torch.float32))
        probs = torch.softmax(logits.double(), dim=1)[0].numpy()
        out.append(int(np.searchsorted(np.cumsum(probs), 1.0 - gen.random())))
    return np.array(out)


def oracle_box(
    module: Gaussian, observations: np.ndarray, generators: list[np.random.Generator]
) -> np.ndarray:
    out = []
    for i, gen in enumerate(generators):
        with torch.no_grad():
            mean = module(torch.as_tensor(observations[i : i + 1], dtype=torch.float32))[0]
        std = np.exp(module.log_std.detach().numpy().astype(np.float64))
        out.append(mean.numpy().astype(np.float64) + std * gen.standard_normal(1))
    return np.array(out, dtype=np.float32)


def generators(ids: range | list[int]) -> list[np.random.Generator]:
    return [np.random.default_rng(POLICY_SEED + i) for i in ids]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{b}-w{w}" for b, w in LAYOUTS])
def test_discrete_actions_are_the_hand_oracles_whatever_the_layout(layout: tuple[str, int]) -> None:
    """Two rollouts (the generators go on from one to the next): every action is the oracle's
    for the observation the policy saw, and the trajectories are the same on every layout."""
    backend, workers = layout
    module = mlp(0)
    policy = TorchPolicy(module, gymnasium.spaces.Discrete(2), seed=POLICY_SEED)
    with envfleet.make("CartPole-v1", N, backend=backend, num_workers=workers, seed=SEED) as pool:
        pool.reset()
        rollouts = [pool.rollout(policy, 12), pool.rollout(policy, 12)]
    gens = generators(range(N))
    for r in rollouts:
        for t in range(r.steps):
            want = oracle_discrete(module, r.observations[t], gens)
            np.testing.assert_array_equal(r.actions[t], want, err_msg=f"step {t}")
    assert 0 < rollouts[0].actions.mean() < 1  # both actions taken: the draws matter
    with envfleet.make("CartPole-v1", N, backend="serial", seed=SEED) as alone:
        alone.reset()
        again = [alone.rollout(policy, 12), alone.rollout(policy, 12)]
    for got, same in zip(rollouts, again, strict=True):
        np.testing.assert_array_equal(got.observations, same.observations)
        np.testing.assert_array_equal(got.actions, same.actions)


@pytest.mark.parametrize("workers", [1, 2])
def test_box_actions_are_the_diagonal_gaussians_of_the_hand_oracle(workers: int) -> None:
    backend = "serial" if workers == 1 else "process"
    module = Gaussian(1)
    space = gymnasium.spaces.Box(-2.0, 2.0, (1,), np.float32)
    policy = TorchPolicy(module, space, seed=POLICY_SEED)
    with envfleet.make("Pendulum-v1", 4, backend=backend, num_workers=workers, seed=SEED) as pool:
        pool.reset()
        r = pool.rollout(policy, 10)
    assert r.actions.dtype == np.float32 and r.actions.shape == (10, 4, 1)
    gens = generators(range(4))
    for t in range(r.steps):
        # The means of one env alone and of a batch may differ in their last bit (BLAS picks
        # its kernel by the batch's size): the same draws, to float32's rounding.
        want = oracle_box(module, r.observations[t], gens)
        np.testing.assert_allclose(r.actions[t], want, rtol=1e-6, atol=1e-6, err_msg=f"step {t}")
    assert r.actions.std() > 0.1  # the noise is there (std exp(-0.5))


def test_weights_round_trip_as_snapshots() -> None:
    space = gymnasium.spaces.Discrete(2)
    source, target = TorchPolicy(mlp(0), space), TorchPolicy(mlp(1), space)
    weights = source.weights()
    assert set(weights) == set(source.module.state_dict())
    assert all(isinstance(w, np.ndarray) for w in weights.values())
    target.load_weights(weights)
    for name, tensor in target.module.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), weights[name])
    with torch.no_grad():  # a snapshot: the module's later updates do not reach it
        next(source.module.parameters()).add_(1.0)
    assert not np.array_equal(source.weights()["0.weight"], weights["0.weight"])
    target.load_weights({k: torch.as_tensor(v) for k, v in source.weights().items()})  # tensors
    np.testing.assert_array_equal(target.weights()["0.weight"], source.weights()["0.weight"])
    views = source.weights(copy=False)  # what the pool packs (one copy, into the frame)
    assert all(np.shares_memory(views[k], t.numpy()) for k, t in source.module.state_dict().items())
    assert not any(np.shares_memory(weights[k], views[k]) for k in weights)
    with pytest.raises(RuntimeError, match="size mismatch"):
        TorchPolicy(mlp(0, out=3), space).load_weights(weights)
    with pytest.raises(RuntimeError, match="Missing key"):
        target.load_weights({k: v for k, v in weights.items() if k != "0.bias"})


def test_the_distribution_is_the_one_sampled_from_with_gradients() -> None:
    module = mlp(0)
    policy = TorchPolicy(module, gymnasium.spaces.Discrete(2))
    obs = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    actions = torch.tensor([0, 1, 1, 0, 1])
    log_probs = policy.distribution(obs).log_prob(actions)
    want = torch.log_softmax(module(torch.as_tensor(obs)), dim=1)[torch.arange(5), actions]
    torch.testing.assert_close(log_probs, want)
    log_probs.sum().backward()  # type: ignore[no-untyped-call]
    assert next(module.parameters()).grad is not None
    box = TorchPolicy(Gaussian(0), gymnasium.spaces.Box(-1, 1, (1,), np.float32))
    x = torch.zeros((2, 3))
    dist = box.distribution(x)
    normal = torch.distributions.Normal(box.module(x), torch.exp(torch.tensor(-0.5)))
    a = torch.tensor([[0.3], [-0.2]])
    want_box = normal.log_prob(a).sum(dim=1)  # type: ignore[no-untyped-call]
    torch.testing.assert_close(dist.log_prob(a), want_box)


def test_one_torch_thread_in_each_worker_and_the_drivers_left_alone() -> None:
    """The policy's actions say how many threads torch runs where it acts: ``threads`` in the
    workers' processes (another value set by a later policy), the driver's own count when it
    runs in the driver's process (serial backend), which it leaves as it was."""
    space = gymnasium.spaces.Discrete(8)
    before = torch.get_num_threads()
    torch.ones(1 << 16).exp().sum()  # this process has used torch's threads before the fork
    with envfleet.make(AnyAction, 4, backend="process", num_workers=2, seed=SEED) as pool:
        pool.reset()
        assert (pool.rollout(TorchPolicy(ThreadsSeen(), space), 3).actions == 1).all()
    with envfleet.make(AnyAction, 2, backend="serial", seed=SEED) as pool:
        pool.reset()
        actions = pool.rollout(TorchPolicy(ThreadsSeen(), space, threads=1), 3).actions
    assert (actions == before).all()
    assert torch.get_num_threads() == before


@pytest.mark.timeout(180)
def test_more_threads_run_in_workers_not_forked_and_are_refused_in_forked_ones() -> None:
    """A forked worker of a process that has used torch's OpenMP threads would hang starting
    more: the policy's error, naming ``threads`` and what to do; the pool goes on. Workers of
    the forkserver run what they are asked."""
    space = gymnasium.spaces.Discrete(8)
    torch.ones(1 << 16).exp().sum()
    with envfleet.make(AnyAction, 4, backend="process", num_workers=2, seed=SEED) as pool:
        pool.reset()
        with pytest.raises(envfleet.EnvError, match=r"TorchPolicy\(threads=3\).*forkserver"):
            pool.rollout(TorchPolicy(ThreadsSeen(), space, threads=3), 3)
        assert (pool.rollout(TorchPolicy(ThreadsSeen(), space), 3).actions == 1).all()
    with envfleet.make(
        AnyAction, 4, backend="process", num_workers=2, seed=SEED, context="forkserver"
    ) as pool:
        pool.reset()
        assert (pool.rollout(TorchPolicy(ThreadsSeen(), space, threads=3), 3).actions == 3).all()
        assert (pool.rollout(TorchPolicy(ThreadsSeen(), space), 3).actions == 1).all()


def test_a_new_version_acts_from_the_next_part_and_is_stamped() -> None:
    """Parts handed over as workers finish, those envs restarted at once with the learner's
    newest weights: each part's actions are the oracle's with the weights of the version
    stamped on it (not the previous one's), each env's generator going on across parts."""
    module = mlp(0)
    policy = TorchPolicy(module, gymnasium.spaces.Discrete(2), seed=POLICY_SEED)
    snapshots: dict[int, dict[str, np.ndarray]] = {}
    parts: list[envfleet.Rollout] = []
    with envfleet.make("CartPole-v1", N, backend="process", num_workers=4, seed=SEED) as pool:
        pool.reset()
        version = pool.rollout_async(policy, 4)
        snapshots[version] = policy.weights()
        for update in range(1, 7):
            part = pool.rollout_wait(min_envs=2)
            parts.append(part)
            with torch.no_grad():  # the learner's update; the bias leans the other way
                for p in module.parameters():
                    p.add_(0.3 * torch.randn_like(p))
                last = module[2]
                assert isinstance(last, nn.Linear)
                last.bias.copy_(torch.tensor([2.0, -2.0]) * (-1) ** update)
            version = pool.rollout_async(policy, 4, env_ids=part.env_ids)
            assert version == update + 1
            snapshots[version] = policy.weights()
        parts.append(pool.rollout_wait())
    modules = {}
    for v, state in snapshots.items():
        modules[v] = mlp(0)
        modules[v].load_state_dict({k: torch.as_tensor(w) for k, w in state.items()})
    gens = generators(range(N))
    stale = 0
    for part in parts:
        for column, i in enumerate(part.env_ids.tolist()):
            (v,) = set(part.policy_versions[:, column].tolist())  # a worker's part: one version
            for t in range(part.steps):
                obs = part.observations[t, column : column + 1]
                if v > 1:  # what the version before would have taken, from the same draw
                    old = oracle_discrete(modules[v - 1], obs, [copy.deepcopy(gens[i])])
                want = oracle_discrete(modules[v], obs, [gens[i]])
                assert part.actions[t, column] == want[0], (i, t, v)
                stale += int(old[0] != want[0]) if v > 1 else 0
    versions = {int(v) for p in parts for v in p.policy_versions.ravel()}
    assert versions >= {1, 2, 3}, versions
    assert stale > 0  # the versions act differently: stale weights would have been seen
    started = 4 * N + sum(4 * len(p.env_ids) for p in parts[:-1])
    assert sum(p.steps * len(p.env_ids) for p in parts) == started  # each env-step once


def test_weights_that_fail_to_load_are_the_policys_error_naming_the_version() -> None:
    """The driver's module changed shape after its code was sent: the workers' copies refuse
    the new weights (torch's own message), named as the policy's error with the version; the
    pool goes on once loadable weights come."""
    module = mlp(0)
    policy = TorchPolicy(module, gymnasium.spaces.Discrete(2), seed=POLICY_SEED)
    with envfleet.make("CartPole-v1", 4, backend="process", num_workers=2, seed=SEED) as pool:
        pool.reset()
        assert pool.rollout_async(policy, 3) == 1
        pool.rollout_wait()
        module[0], module[2] = nn.Linear(4, 5), nn.Linear(5, 2)
        assert pool.rollout_async(policy, 3) == 2
        with pytest.raises(envfleet.EnvError) as caught:
            pool.rollout_wait()
        message = str(caught.value)
        assert "the rollout's policy could not load the weights of version 2" in message
        assert "size mismatch for 0.weight" in message
        module[0], module[2] = nn.Linear(4, 16), nn.Linear(16, 2)
        assert pool.rollout_async(policy, 3) == 3
        assert pool.rollout_wait().steps == 3


@pytest.mark.parametrize(
    ("args", "error", "names"),
    [
        ((nn.Linear(4, 2), gymnasium.spaces.MultiDiscrete([2, 2])), ValueError, "action_space"),
        ((nn.Linear(3, 1), gymnasium.spaces.Box(-1, 1, (1,))), ValueError, "log_std='log_std'"),
        (("not a module", gymnasium.spaces.Discrete(2)), TypeError, "module"),
        ((nn.Linear(4, 2, device="meta"), gymnasium.spaces.Discrete(2)), ValueError, "module"),
    ],
)
def test_what_it_cannot_run_is_refused_naming_the_argument(
    args: tuple[Any, Any], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=f"TorchPolicy\\({names}"):
        TorchPolicy(*args)
    with pytest.raises(ValueError, match="threads"):
        TorchPolicy(nn.Linear(4, 2), gymnasium.spaces.Discrete(2), threads=0)
