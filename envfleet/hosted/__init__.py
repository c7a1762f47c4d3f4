"""Hosted VectorEnvs: a worker steps a batched simulator for its block of envs.

Many fast simulators are batched already (Gymnasium's ``vector_entry_point`` envs such as
``CartPole-v1``'s numpy ``CartPoleVectorEnv``, ale-py's C++ ``AtariVectorEnv``, EnvPool). A
pool made with ``vectorization_mode="vector_entry_point"`` (or ``vector_env_fns=[...]``) has
each worker build one ``gymnasium.vector.VectorEnv`` for its block of ``k`` consecutive envs
and step it with one call; its results land in the batch with one copy per field::

    pool.step(actions) ── one command per worker ──► HostedGroup.step(block)
                                                     venv.step(actions[block])   (one call)
                                                     batch[block] = obs, rewards, flags
                                                     infos: one dict per env that has one

The pool stays the same ``VectorEnv``: global indices, ``seed + i`` per env where the hosted
env takes a seed per env (``SyncVectorEnv``, ``AsyncVectorEnv``, ale-py's ``AtariVectorEnv``;
Gymnasium's numpy vector envs take one seed: their block gets ``seed + i0``, its first env's),
the autoreset mode (the hosted env's must be the pool's), infos merged Gymnasium's way,
``call``/``get_attr``/``set_attr``, rollouts and restarts: a hosted VectorEnv that raises is
rebuilt whole under ``on_error="restart"``, and every env of its block reports its episode
truncated (reward 0, ``infos["envfleet/restarted"]``, the last observation kept); a worker that
dies or hangs is rebuilt by its transport as any other.

Rewards come back as ``float64`` whatever the hosted env's dtype (numpy vector envs give
``float32``): the pool's arrays are those of every envfleet pool and of ``SyncVectorEnv``; the
values are the same (a ``float32`` is exact in ``float64``).
"""

from envfleet.hosted.batches import unbatch_infos
from envfleet.hosted.group import HostedGroup
from envfleet.hosted.plan import hosted_plan
from envfleet.hosted.recipe import RESTARTED, HostedRecipe, HostedSpec, VectorFactory

__all__ = [
    "RESTARTED",
    "HostedGroup",
    "HostedRecipe",
    "HostedSpec",
    "VectorFactory",
    "hosted_plan",
    "unbatch_infos",
]
