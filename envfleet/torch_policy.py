"""A PyTorch policy that runs on the workers: :class:`TorchPolicy`.

The policy wraps a ``torch.nn.Module`` on the CPU. Its code (the module, pickled) travels to
each worker once; each version's weights (the module's ``state_dict`` as numpy arrays) travel
apart, once per worker that lacks them (see :mod:`envfleet.shipping`)::

    driver: TorchPolicy(module, action_space, seed) ── pool.rollout_async(policy, T)
            code: the policy pickled once; weights(): the state_dict, per version
    worker: load_weights(state) when a new version comes; torch.set_num_threads(threads)
            once per process; per step: out = module(observations) (no autograd);
            env i draws from its own generator (seed + i); actions from ``out``, vectorised

Env ``i`` draws its randomness from a numpy generator seeded ``seed + i`` (one uniform, or one
normal per action dimension, per step), so a rollout with given weights takes the same actions
whatever the layout of workers and nodes. The draws become actions over the whole batch at once:
a categorical by inverse CDF (``Discrete``), a diagonal Gaussian (``Box``).

torch is imported when a policy is built or unpickled, never by ``import envfleet``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces

if TYPE_CHECKING:
    import torch

_BOOT = uuid.uuid4().hex
"""This import of the module: with the process id, tells a process from its driver's (a forked
child inherits the module, not its process id; a process elsewhere imports it anew)."""

_threads_set: int | None = None
"""The thread count a policy set in this process (``None``: none did)."""


def _process() -> tuple[str, int]:
    return _BOOT, os.getpid()


class TorchPolicy:
    """A ``torch.nn.Module`` as a rollout's policy: its code travels once, its weights per version.

    For a ``Discrete(n)`` action space the module maps a batch of observations to logits
    ``(batch, n)``, and env ``i``'s action is drawn from the categorical they give with a uniform
    from its generator (seeded ``seed + i``). For a ``Box`` action space the module maps them to
    the means ``(batch, *shape)``; the log standard deviation is the module's tensor named
    ``log_std`` (a parameter or buffer, broadcast to the action's shape), and env ``i``'s action
    is ``mean + exp(log_std) * z`` with ``z`` standard normal draws from its generator (not
    clipped to the bounds: the log-probability is that of the action taken). Other action
    spaces are refused. Observations reach the module as tensors (floating ones in the dtype of
    the module's parameters; a Dict or Tuple space as a dict or tuple of tensors).

    Each worker (another process than the one that built the policy: worker processes, Ray
    actors, node agents' workers) runs torch on ``threads`` intra-op threads, set once in its
    process, so that workers do not oversubscribe the cores. Building or calling the policy in
    the driver's process (the ``serial`` and ``thread`` backends included) leaves torch's
    threads as the driver set them. More than one thread in a worker forked from the process
    that built the policy (the ``fork`` start method) is refused as the policy's error: torch's
    OpenMP threads hang there once the parent has used them; ``make(context="forkserver")``
    or ``"spawn"`` workers may run several.

    Args:
        module: the policy network, on the CPU (a GPU module is refused: keep a GPU policy on
            the driver, with ``send``/``recv``). Held, not copied: ``weights()`` reads its
            current parameters, so a learner that updates it ships its new weights with the
            next rollout.
        action_space: the pool's single action space: ``Discrete`` or ``Box``.
        seed: the base seed: env ``i`` draws from ``numpy.random.default_rng(seed + i)``
            (``None``: unseeded).
        threads: torch intra-op threads in each worker process (``None``: torch's default
            there, every core for a worker that was not forked).
        log_std: ``Box`` only: the name of the module's log standard deviation in its
            ``state_dict``.

    Raises:
        ImportError: torch is not installed.
        TypeError: ``module`` is not a ``torch.nn.Module``.
        ValueError: another action space, a module not on the CPU, ``threads`` below 1, or no
            tensor named ``log_std`` for a ``Box`` space.

    Examples:
        >>> import numpy as np, torch
        >>> from gymnasium import spaces
        >>> from envfleet import TorchPolicy
        >>> policy = TorchPolicy(torch.nn.Linear(4, 2), spaces.Discrete(2), seed=0)
        >>> obs = np.zeros((3, 4), dtype=np.float32)
        >>> a = policy(obs, np.array([0, 1, 2]))  # env i draws from default_rng(0 + i)
        >>> a.dtype, a.shape
        (dtype('int64'), (3,))
        >>> sorted(policy.weights())  # the state_dict, as numpy arrays
        ['bias', 'weight']
    """

    def __init__(
        self,
        module: torch.nn.Module,
        action_space: spaces.Space[Any],
        seed: int | None = None,
        threads: int | None = 1,
        log_std: str = "log_std",
    ) -> None:
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("TorchPolicy needs torch: pip install 'envfleet[torch]'") from exc
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"TorchPolicy(module=...) takes a torch.nn.Module, got {module!r}")
        devices = {t.device.type for t in [*module.parameters(), *module.buffers()]}
        if devices - {"cpu"}:
            raise ValueError(
                f"TorchPolicy(module=...) runs on the workers' CPUs, but the module has tensors "
                f"on {sorted(devices - {'cpu'})}: pass a CPU copy (copy.deepcopy(module).cpu()), "
                "or keep a GPU policy on the driver and step the envs with send/recv"
            )
        if type(action_space) not in (spaces.Discrete, spaces.Box):
            raise ValueError(
                f"TorchPolicy(action_space=...) takes a Discrete (categorical over logits) or "
                f"Box (diagonal Gaussian) space, got {action_space}"
            )
        if isinstance(action_space, spaces.Box) and log_std not in module.state_dict():
            raise ValueError(
                f"TorchPolicy(log_std={log_std!r}): a Box action space needs the log standard "
                f"deviation as a tensor of the module's state_dict, and it has no {log_std!r} "
                f"(its entries: {sorted(module.state_dict())})"
            )
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ValueError(
                f"TorchPolicy(threads=...) must be an int >= 1 or None, got {threads!r}"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer)):
            raise TypeError(f"TorchPolicy(seed=...) must be an int or None, got {seed!r}")
        self.module = module
        self.action_space = action_space
        self.seed = None if seed is None else int(seed)
        self.threads = threads
        self.log_std = log_std
        self._home = _process()
        self._generators: dict[int, np.random.Generator] = {}
        self._ready = False  # threads set (or left alone) in this process

    # -- weights apart from code -----------------------------------------------------------------

    def weights(self, copy: bool = True) -> dict[str, np.ndarray]:
        """The module's ``state_dict`` as numpy arrays: a snapshot, copied (bfloat16 as
        float32; :meth:`load_weights` casts back). ``copy=False``: views of the module's CPU
        tensors, for a caller that copies them at once (the pool packs each version into a
        frame: one copy, not two)."""
        import torch

        out = {}
        for name, tensor in self.module.state_dict().items():
            value = tensor.detach().cpu()
            if value.dtype == torch.bfloat16:
                value = value.float()
            array = value.numpy()
            out[name] = array.copy() if copy else array
        return out

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        """Load a ``state_dict`` (numpy arrays or tensors) into the module, strictly: a
        missing or unexpected name, or another shape, raises (torch's ``RuntimeError``)."""
        import torch

        if not isinstance(weights, Mapping):
            raise TypeError(f"load_weights takes a mapping of names to arrays, got {weights!r}")
        state = {
            name: value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
            for name, value in weights.items()
        }
        self.module.load_state_dict(state, strict=True)

    # -- acting ----------------------------------------------------------------------------------

    def __call__(self, observations: Any, env_ids: np.ndarray) -> np.ndarray:
        """The actions of the envs ``env_ids`` (global indices) for their ``observations``."""
        import torch

        if not self._ready:
            self._set_threads()
        ids = np.asarray(env_ids, dtype=np.int64).reshape(-1).tolist()
        with torch.inference_mode():
            out = self.module(self.tensors(observations)).detach()
            if isinstance(self.action_space, spaces.Discrete):
                return self._categorical(out, ids)
            return self._gaussian(out, ids)

    def _categorical(self, logits: torch.Tensor, ids: list[int]) -> np.ndarray:
        """Env ``ids[k]``'s action: the first whose cumulative probability reaches its draw
        ``u`` in (0, 1] (inverse CDF; the last action past every other boundary, whatever the
        rounding of the sum), for every env at once."""
        import torch

        space = self.action_space
        assert isinstance(space, spaces.Discrete)
        n = int(space.n)
        if tuple(logits.shape) != (len(ids), n):
            raise ValueError(
                f"the module returned logits of shape {tuple(logits.shape)}; a Discrete({n}) "
                f"action space over {len(ids)} envs needs {(len(ids), n)}"
            )
        probs = torch.softmax(logits.to(torch.float64), dim=1).cpu().numpy()
        u = np.fromiter((1.0 - self._generator(i).random() for i in ids), np.float64, len(ids))
        index = (np.cumsum(probs[:, :-1], axis=1) < u[:, None]).sum(axis=1)
        return np.asarray(index + int(space.start), dtype=space.dtype)

    def _gaussian(self, means: torch.Tensor, ids: list[int]) -> np.ndarray:
        """Env ``ids[k]``'s action: its mean plus the standard deviation times normal draws
        from its generator."""
        space = self.action_space
        assert isinstance(space, spaces.Box)
        shape = (len(ids), *space.shape)
        if tuple(means.shape) != shape:
            raise ValueError(
                f"the module returned means of shape {tuple(means.shape)}; a Box action space "
                f"of shape {space.shape} over {len(ids)} envs needs {shape}"
            )
        std = np.exp(self._log_std().detach().cpu().numpy().astype(np.float64))
        z = np.stack([self._generator(i).standard_normal(space.shape) for i in ids])
        mean = means.cpu().numpy().astype(np.float64)
        return np.asarray(mean + std * z, dtype=space.dtype)

    def distribution(self, observations: Any) -> torch.distributions.Distribution:
        """The action distribution for a batch of observations, with autograd (for a learner:
        log-probabilities of the actions taken, entropy). ``Categorical`` over the logits
        (its values count from 0: subtract the space's ``start``), or an ``Independent``
        ``Normal`` over the action's dimensions."""
        from torch.distributions import Categorical, Independent, Normal

        out = self.module(self.tensors(observations))
        if isinstance(self.action_space, spaces.Discrete):
            return Categorical(logits=out)
        std = self._log_std().exp().expand_as(out)
        return Independent(Normal(out, std), len(self.action_space.shape or ()))

    def tensors(self, observations: Any) -> Any:
        """``observations`` as the module takes them: tensors (floating ones in the dtype of
        its parameters), dicts and tuples kept."""
        import torch

        if isinstance(observations, dict):
            return {key: self.tensors(value) for key, value in observations.items()}
        if isinstance(observations, tuple):
            return tuple(self.tensors(value) for value in observations)
        if isinstance(observations, torch.Tensor):
            tensor = observations
        else:
            array = np.asarray(observations)
            tensor = torch.as_tensor(array if array.flags.writeable else array.copy())
        if tensor.is_floating_point():
            dtype = next(
                (p.dtype for p in self.module.parameters() if p.is_floating_point()),
                torch.get_default_dtype(),
            )
            tensor = tensor.to(dtype)
        return tensor

    # -- per env, per process --------------------------------------------------------------------

    def _generator(self, i: int) -> np.random.Generator:
        gen = self._generators.get(int(i))
        if gen is None:
            seed = None if self.seed is None else self.seed + int(i)
            gen = self._generators[int(i)] = np.random.default_rng(seed)
        return gen

    def _log_std(self) -> torch.Tensor:
        module = self.module
        named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        return named[self.log_std]

    def _set_threads(self) -> None:
        """In a worker's process (not the one that built the policy): torch's intra-op threads
        set to ``threads``, once per process. A worker forked from that process may not run
        more than one: GNU OpenMP, torch's thread pool, hangs in a forked child whose parent
        has used it (which is why torch's own DataLoader workers run one thread)."""
        global _threads_set
        import torch

        home, here = self._home, _process()
        if home == here:  # the driver's own process: its threads are the driver's business
            self._ready = True
            return
        wanted = torch.get_num_threads() if self.threads is None else self.threads
        if home[0] == here[0] and wanted > 1:  # this module came with the fork
            raise RuntimeError(
                f"TorchPolicy(threads={self.threads}) asks for {wanted} torch threads in a worker "
                "forked from the process that built the policy, where torch's OpenMP threads "
                "cannot start again (it would hang): use threads=1, or workers that are not "
                "forked (make(..., context='forkserver') or 'spawn'; Ray's actors are not)"
            )
        if self.threads is not None and _threads_set != self.threads:
            torch.set_num_threads(self.threads)
            _threads_set = self.threads
        self._ready = True

    def __getstate__(self) -> dict[str, Any]:
        # Each copy's generators start at seed + i: a worker's draws do not depend on what
        # the driver's copy drew before it was sent.
        return {**self.__dict__, "_generators": {}, "_ready": False}

    def __repr__(self) -> str:
        name = type(self.module).__name__
        return f"TorchPolicy({name}, {self.action_space}, seed={self.seed}, threads={self.threads})"


__all__ = ["TorchPolicy"]
