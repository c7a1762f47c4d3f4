"""``envfleet.make``: strings become Enums and checked numbers here, at the edge.

What ``make()`` runs in the caller's own process before any worker starts (building one env to
learn its spaces, profiling it for a layout, each bounded by ``start_timeout``) is
:mod:`envfleet.caller_build`'s.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from gymnasium.vector import AutoresetMode

from envfleet import caller_build
from envfleet.affinity import CpuAffinity, check_affinity, usable_cpus
from envfleet.backends.contract.base import DEFAULT_START_TIMEOUT, TransportOptions
from envfleet.backends.contract.registry import (
    Backend,
    TransportKind,
    backend_options,
    kind_of,
    open_transport,
    refusal,
)
from envfleet.caller_registry import CallerRegistry
from envfleet.errors import EnvTimeoutError, OnError, Phase
from envfleet.make_checks import as_enum, hosted_args, positive_int, seconds
from envfleet.pool import DEFAULT_MAX_RESTARTS, Pool
from envfleet.spec import EnvSpec
from envfleet.tune import EnvProfile, choose_layout, profile_env

__all__ = ["START_METHODS", "make"]

START_METHODS = ("fork", "forkserver", "spawn")


def make(
    env: Any = None,
    num_envs: int | None = None,
    *,
    backend: str | Backend | TransportKind = Backend.PROCESS,
    num_workers: int | Literal["auto"] | None = None,
    batch_size: int | None = None,
    seed: int | None = None,
    copy: bool = True,
    env_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    check_actions: bool = False,
    autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
    context: str | None = None,
    on_error: str | OnError = OnError.RAISE,
    step_timeout: float | None = None,
    start_timeout: float = DEFAULT_START_TIMEOUT,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    worker_memory_limit: int | None = None,
    threads_per_worker: int = 1,
    cpu_affinity: CpuAffinity | None = None,
    vectorization_mode: str | None = None,
    vector_env_fns: Sequence[Callable[[], Any]] | None = None,
    **options: Any,
) -> Pool:
    """Run ``num_envs`` environments in parallel behind one ``VectorEnv``.

    Args:
        env: a registered id (``"CartPole-v1"``, ``"ALE/Pong-v5"``), an env class or a
            zero-argument callable returning an env (closures work under every start method);
            or a sequence of those, one per env, as Gymnasium's ``AsyncVectorEnv(env_fns)``:
            env ``i`` is built (and rebuilt on a restart) by ``env[i]``. The envs may differ
            (kwargs, tasks, render modes) but must share their observation and action spaces;
            metadata and render mode are env 0's, as in Gymnasium.
        num_envs: number of envs; may be omitted when ``env`` or ``env_kwargs`` is a
            sequence (it is then their length, and must equal it if given).
        backend: ``"process"`` (worker processes, shared memory), ``"thread"`` (threads of this
            process, for envs that sleep or release the GIL), ``"ray"`` (one Ray actor per
            worker, local or on a cluster) or ``"serial"`` (the caller's thread; the reference
            semantics).
        num_workers: worker processes (default: usable cores, at most ``num_envs``; for the
            thread backend, one per env); envs are split over them in contiguous blocks that
            need not be equal. ``"auto"`` probes the env for a fraction of a second and picks
            workers (and ``threads_per_worker`` for envs that mostly wait), as ``envfleet tune``
            would. An async pool (``batch_size < num_envs``) of the process backend with
            ``num_workers`` and ``threads_per_worker`` unset is laid out as ``"auto"``: envs
            that mostly wait get up to :data:`~envfleet.tune.ASYNC_WORKERS_PER_CORE` workers
            per core, so that one slow env does not hold back a whole core's share of envs (an
            env that cannot be timed in this process keeps the default).
        batch_size: envs returned per :meth:`Pool.recv` (default ``num_envs``: synchronous).
        seed: env ``i`` is reset with ``seed + i`` on the first reset; also seeds the action
            spaces.
        copy: ``False`` returns the observations of a sync ``step`` or ``reset`` as the
            pool's batch arrays themselves (shared memory on the process backend), saving a
            copy per step; the next step overwrites them, so copy what you keep. Gymnasium's
            ``copy`` of its vector envs. An async batch whose envs are consecutive, in order
            (one worker's block: double buffering on two workers), comes as views too; any
            other async batch is a copy. With ``True`` on the process backend, a sync step's
            image observations (a batch of 64 KB or more) are copied by the workers into one
            of two spare blocks of shared memory, handed out as they are: the block is yours
            until nothing refers to it any more (docs/benchmarks.md, "Spare rows"); a child
            forked while you hold one shares its memory rather than copying it on write.
        env_kwargs: keyword arguments for ``gymnasium.make`` or the factory: one mapping for
            every env, or a sequence of mappings, one per env.
        check_actions: also check that each action lies in the action space before sending it
            (``ValueError`` naming the env). Off by default: as in Gymnasium's vector envs,
            whether an action is valid is the env's business (an env may accept more than its
            space says); the count and shape of the batch are always checked.
        autoreset_mode: Gymnasium's ``NEXT_STEP`` (default), ``SAME_STEP`` or ``DISABLED``.
        context: multiprocessing start method for the process backend (``"fork"``,
            ``"forkserver"``, ``"spawn"``; default: the platform's).
        on_error: ``"raise"`` (default): the first failure raises an :class:`EnvError` naming
            the env, phase and worker; ``"restart"``: the failed env (or its worker's envs,
            when the worker died or hung) is rebuilt and its episode reported truncated with
            ``infos["envfleet/restarted"]``.
        step_timeout: seconds a step/reset/call may take before its worker is killed and
            handled as dead (process and ray backends).
        start_timeout: seconds each worker may take to build its envs, at ``make()`` and when
            a worker is rebuilt by a restart, before it is stopped and :class:`EnvTimeoutError`
            (phase ``make``) is raised. The rebuild of one failed env inside a worker process
            or Ray actor has it too (past it the worker ends itself, and is handled as dead),
            and inside a worker thread (built on a helper thread, abandoned past it: a failure
            of that env, phase ``make``).
            The env ``make()`` first builds in this process to learn the spaces has the same
            bound (it is built on a helper thread, abandoned if it hangs), as long as its
            constructor lets Python run: one that holds the GIL in C code delays ``make()``
            until it lets go (the workers' own builds are bounded whatever they do). On the
            thread backend a stuck thread cannot be stopped: it is abandoned (a
            daemon). The serial backend builds in the caller's thread and is not bounded.
        max_restarts: restarts allowed per env over the pool's life before
            :class:`RestartLimitError`.
        worker_memory_limit: process and ray backends: bytes of resident memory (RSS) a worker
            (a process; a Ray actor on this machine, whose memory this process can read) may
            use. Checked between steps (at most once a second); a worker over it is replaced, its
            envs restarted as under ``on_error="restart"`` (episode reported truncated,
            ``infos["envfleet/restarted"]``) whatever ``on_error`` says, and counted in
            :meth:`Pool.stats` (``recycled``). ``None`` (default): no limit.
        threads_per_worker: process and ray backends: each worker steps its envs on this many
            threads, so envs that sleep or release the GIL overlap inside a worker.
        cpu_affinity: pin each worker (thread, process or Ray actor, with the threads it
            starts) to CPUs; Linux only. ``None`` (default): no pinning. ``"spread"``: worker
            ``w`` on the ``w % n``-th usable CPU, one core each (EnvPool's
            ``thread_affinity_offset=0``). A sequence of CPU ids (``[1]``): every worker on
            those. A sequence of sequences (``[[0], [1]]``): worker ``w`` on entry
            ``w % len``. Envs that mostly wait, on the thread backend, run faster with their
            threads packed on one core (``cpu_affinity=[1]`` on 2 cores): GIL hand-offs stay
            on that core. CPU-bound envs want ``"spread"`` at most. The caller's thread is
            never pinned.
        vectorization_mode: ``"vector_entry_point"``: each worker hosts the id's own
            ``VectorEnv`` (``gymnasium.make_vec``) for its block of envs (docs/hosted.md).
        vector_env_fns: zero-argument factories, each building one ``VectorEnv`` (a block of
            envs; ``num_envs`` is their sum): a worker per factory, or ``num_workers`` fewer,
            each hosting a contiguous run of them (docs/hosted.md).
        **options: the backend's own options, routed to it (each backend declares them in
            the registry, :mod:`envfleet.backends.contract.registry`; ``None`` stands for the
            default).
            The ray backend's (:class:`~envfleet.backends.ray.options.RayOptions`):
            ``address`` (``None``: the Ray this process is connected to, else a private local
            one; ``"auto"`` or ``"ray://host:port"``: join a cluster), ``ray_init_kwargs``
            (for ``ray.init``), ``worker_resources`` (``.options()`` of each actor),
            ``ray_shared_memory`` (``False``: every command a Ray call), ``nodes``
            (``None``: one sub-pool per node on a cluster of several nodes, each command one
            message per node; ``"auto"`` or Ray node ids: always; ``False``: one actor per
            worker), ``compress`` (node sub-pools: ``"lz4"`` or ``"zlib"``, lossless
            compression of image observations on their way to the pool, rollouts' too) and
            ``connect_timeout`` (seconds a join of a cluster may take, default 20; no Ray at
            the address: a :class:`ConnectionError` naming it, at once where nothing listens).

    Returns:
        Pool: the envs, behind one ``gymnasium.vector.VectorEnv``; close it (or use it as a
            context manager) to free its workers.

    Raises:
        ValueError, TypeError: an argument is invalid; the message says what was expected.
        EnvError: building the env failed.
        ConnectionError: ``backend="ray"`` with an ``address``: no Ray answered there within
            ``connect_timeout``.

    Examples:
        >>> import envfleet
        >>> with envfleet.make("CartPole-v1", num_envs=4, backend="serial", seed=0) as pool:
        ...     obs, infos = pool.reset()
        ...     obs, rewards, terminations, truncations, infos = pool.step([0, 1, 0, 1])
        >>> obs.shape, rewards.tolist()
        ((4, 4), [1.0, 1.0, 1.0, 1.0])
    """
    kind = kind_of(backend)
    can = kind.capabilities  # what it honours: asked below, never its name
    own = backend_options(kind, options)  # routed to the backend that declared them
    mode: AutoresetMode = as_enum(AutoresetMode, autoreset_mode, "autoreset_mode")
    hosted = hosted_args(
        env, num_envs, env_kwargs, vectorization_mode, vector_env_fns, num_workers, kind, mode
    )
    spec = hosted[0] if hosted is not None else EnvSpec.from_user(env, env_kwargs)
    # Ids the caller registered, for factories that gymnasium.make them in fresh workers.
    spec = dataclasses.replace(spec, caller_registry=CallerRegistry.snapshot())
    if hosted is not None:
        if num_envs is not None and num_envs != hosted[1]["num_envs"]:
            raise ValueError(
                f"num_envs={num_envs} but the vector_env_fns build {hosted[1]['num_envs']} "
                "envs in all: omit num_envs"
            )
        num_envs = hosted[1]["num_envs"]
        num_workers = len(hosted[1]["workers"])
        if threads_per_worker != 1:
            raise ValueError(
                "threads_per_worker: a worker hosting a VectorEnv steps it with one call "
                "(give the hosted env its own threads, as AtariVectorEnv's num_threads)"
            )
    if num_envs is None:
        if spec.num_envs is None:
            raise TypeError(
                "make() needs num_envs, unless env (or env_kwargs) is a sequence with one "
                "entry per env"
            )
        num_envs = spec.num_envs
    num_envs = positive_int(num_envs, "num_envs")
    if spec.num_envs is not None and spec.num_envs != num_envs:
        raise ValueError(
            f"num_envs={num_envs} but {spec.num_envs} envs were given (one per entry of env "
            "or env_kwargs): omit num_envs, or give one entry per env"
        )
    if not isinstance(check_actions, bool):
        raise TypeError(f"check_actions must be True or False, got {check_actions!r}")
    batch_size = num_envs if batch_size is None else positive_int(batch_size, "batch_size")
    if batch_size > num_envs:
        raise ValueError(f"batch_size={batch_size} exceeds num_envs={num_envs}")
    if hosted is not None and batch_size < num_envs:
        sizes = {size for _, size in hosted[1]["blocks"]}
        if len(sizes) != 1 or batch_size % next(iter(sizes)):
            raise ValueError(
                f"batch_size={batch_size}: a hosted VectorEnv steps its whole block of envs, "
                f"so an async batch is whole blocks; the blocks hold {sorted(sizes)} envs"
            )
    auto = num_workers == "auto"
    # An async pool whose layout is left to us is laid out as "auto" would: envs that wait get
    # more workers, so that a slow env holds few others back (issue 23).
    async_default = (
        num_workers is None
        and batch_size < num_envs
        and threads_per_worker == 1
        and can.local_cpus
        and not (can.one_worker or can.worker_per_env)
    )
    if auto:
        num_workers = None
    if num_workers is None:
        # Threads are for envs that wait (sleep, I/O, GIL-free C code): one per env.
        num_workers = num_envs if can.worker_per_env else min(len(usable_cpus()), num_envs)
    num_workers = positive_int(num_workers, "num_workers")
    if num_workers > num_envs:
        raise ValueError(f"num_workers={num_workers} exceeds num_envs={num_envs}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if seed is not None and seed < 0:
        raise ValueError(f"seed must be a non-negative int (numpy seeds), got {seed}")
    if context is not None and context not in START_METHODS:
        raise ValueError(f"context must be one of {START_METHODS} or None, got {context!r}")
    policy: OnError = as_enum(OnError, on_error, "on_error")
    if step_timeout is not None:
        step_timeout = seconds(step_timeout, "step_timeout")
        if not can.step_timeout:
            raise ValueError(refusal("step_timeout", kind))
    start_timeout = seconds(start_timeout, "start_timeout")
    if worker_memory_limit is not None:
        worker_memory_limit = positive_int(worker_memory_limit, "worker_memory_limit")
        if not can.worker_memory_limit:
            raise ValueError(refusal("worker_memory_limit", kind))
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a non-negative int, got {max_restarts!r}")
    threads_per_worker = positive_int(threads_per_worker, "threads_per_worker")
    if threads_per_worker > 1 and not can.threads_per_worker:
        raise ValueError(refusal("threads_per_worker", kind))
    affinity = check_affinity(cpu_affinity, check_usable=can.local_cpus)
    if affinity is not None and not can.cpu_affinity:
        raise ValueError(refusal("cpu_affinity", kind))
    if not isinstance(copy, bool):
        raise TypeError(f"copy must be True or False, got {copy!r}")
    bound = start_timeout if can.start_timeout else None
    # The envs built here (to learn the spaces, to profile) are not the pool's: the global RNGs
    # that a factory may draw from (domain randomisation) are put back as they were, so that
    # the pool's env i draws what SyncVectorEnv's env i draws.
    global_rngs = np.random.get_state(), random.getstate()
    probe_started = time.perf_counter()
    probe = hosted[1] if hosted is not None else caller_build.probe(spec, bound)
    probe_seconds = time.perf_counter() - probe_started
    if (auto or async_default) and hosted is None:
        why = "num_workers='auto'" if auto else "the layout of an async pool"
        profile: EnvProfile | None
        try:
            try:
                profile = (
                    profile_env(spec)
                    if bound is None
                    else caller_build.within(bound, spec, profile_env, f"profiling ({why})")
                )
            except Exception as exc:
                if not caller_build.wants_main_thread(exc):
                    raise
                profile = profile_env(spec)  # as the probe: it failed at once, it did not hang
        except Exception:
            if auto:
                raise
            # An async pool's layout is only advice: an env that cannot be stepped here fails
            # in its worker, named, as it did before the pool asked.
            profile = None
        if profile is not None:
            num_workers, auto_threads, _ = choose_layout(
                profile, can, num_envs, len(usable_cpus()), batch_size=batch_size
            )
            if threads_per_worker == 1:
                threads_per_worker = auto_threads
    np.random.set_state(global_rngs[0])
    random.setstate(global_rngs[1])
    if can.one_worker:
        num_workers = 1

    assignment = [
        tuple(int(i) for i in ids) for ids in np.array_split(np.arange(num_envs), num_workers)
    ]
    if hosted is not None:  # each worker's run of hosted VectorEnvs (serial: all of them)
        blocks = [tuple(range(s, s + n)) for s, n in hosted[1]["blocks"]]
        runs = [range(len(blocks))] if can.one_worker else hosted[1]["workers"]
        assignment = [sum((blocks[b] for b in run), ()) for run in runs]
    transport_options = TransportOptions(
        spec=spec,
        assignment=assignment,
        observation_space=probe["observation_space"],
        action_space=probe["action_space"],
        autoreset_mode=mode,
        context=context,
        on_error=policy,
        seed_base=None if seed is None else int(seed),
        threads_per_worker=threads_per_worker,
        cpu_affinity=affinity,
        start_timeout=start_timeout,
        step_timeout=step_timeout,
        copy=copy,
        backend_options=own,
    )
    try:
        transport = open_transport(kind, transport_options)
    except EnvTimeoutError as exc:
        if exc.phase is Phase.MAKE and exc.args:  # past start_timeout: say what took the time
            exc.args = (
                f"{exc.args[0]}. {caller_build.start_cost(probe, probe_seconds, assignment)}",
            )
        raise
    try:
        return Pool(
            transport,
            assignment,
            backend=kind,
            env_name=spec.name,
            observation_space=probe["observation_space"],
            action_space=probe["action_space"],
            metadata=probe["metadata"],
            render_mode=probe["render_mode"],
            autoreset_mode=mode,
            batch_size=batch_size,
            seed=None if seed is None else int(seed),
            on_error=policy,
            step_timeout=step_timeout,
            max_restarts=max_restarts,
            copy=copy,
            check_actions=check_actions,
            worker_memory_limit=worker_memory_limit,
        )
    except BaseException:
        transport.workers.close(1.0)  # whatever fails after the workers started stops them
        raise
