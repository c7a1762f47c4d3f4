"""What ``make()`` runs in the caller's own process before any worker starts.

:func:`probe` builds one env to learn its spaces, metadata and render mode (and fails fast on a
broken factory); :func:`within` runs such a task on a helper thread bounded by
``start_timeout`` (a constructor that hangs fails ``make()`` with no worker started; the
thread is abandoned). An env that must be built on the main thread is built again there, if
this is it (:func:`wants_main_thread`). :func:`start_cost` says what a worker's start costs,
as measured here, for a ``start_timeout`` message.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from envfleet.errors import EnvRaisedError, EnvTimeoutError, Phase, env_raised_error
from envfleet.guards import Abandoned, build_within, env_errors
from envfleet.protocol import EnvFailure
from envfleet.spec import EnvSpec
from envfleet.validation import bounds_nbytes

__all__ = [
    "PROBE_CLOSE_TIMEOUT",
    "build_probe",
    "close_probe",
    "probe",
    "start_cost",
    "wants_main_thread",
    "within",
]

T = TypeVar("T")


def probe(spec: EnvSpec, timeout: float | None = None) -> dict[str, Any]:
    """Build one env in the caller to learn its spaces (and fail fast on a broken factory).

    With a ``timeout`` (the backends that bound construction: ``start_timeout``), the env is
    built on a helper thread (:func:`within`): a constructor that hangs fails ``make()``
    before any worker starts. One that refuses to run off the main thread (it installs a
    signal handler, say) is built again on this thread, if it is the main one: it failed at
    once, it did not hang.
    """
    if timeout is None:
        env = build_probe(spec)
    else:
        try:
            env = within(timeout, spec, build_probe, "building", discard=close_probe)
        except EnvRaisedError as exc:
            if not wants_main_thread(exc.__cause__):
                raise
            env = build_probe(spec)
    try:
        return {
            "observation_space": env.observation_space,
            "action_space": env.action_space,
            "metadata": dict(env.metadata),
            "render_mode": env.render_mode,
        }
    finally:
        close_probe(env)


def start_cost(
    probe: dict[str, Any], probe_seconds: float, assignment: Sequence[tuple[int, ...]]
) -> str:
    """What a worker's start-up costs, as measured here: for a start_timeout message."""
    per_worker = max(len(ids) for ids in assignment)
    nbytes = bounds_nbytes(probe["observation_space"]) + bounds_nbytes(probe["action_space"])
    return (
        f"Measured in this process: building one env (and closing it) took {probe_seconds:.3g}s, "
        f"and a worker builds up to {per_worker} (about {per_worker * probe_seconds:.3g}s); "
        f"the spaces' bounds hold {nbytes / 1e6:.3g} MB, sent to each worker and compared "
        "with each env's spaces. Raise start_timeout if that is the cost of these envs"
    )


def wants_main_thread(exc: BaseException | None) -> bool:
    """Whether ``exc`` says that its code must run on the main thread (and this is it)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        return "main thread" in str(exc)
    except Exception:
        return False


def within(
    timeout: float,
    spec: EnvSpec,
    task: Callable[[EnvSpec], T],
    what: str,
    discard: Callable[[T], None] | None = None,
) -> T:
    """``task(spec)`` on a helper thread (:func:`envfleet.guards.build_within`), waited for at
    most ``timeout`` seconds: past it :class:`EnvTimeoutError` (phase ``make``), the stuck
    thread abandoned; should it finish after all, ``discard`` gets its result (an env to
    close). What ``task`` raises is raised here."""
    try:
        return build_within(timeout, lambda: task(spec), discard, name="envfleet-probe")
    except Abandoned:
        raise EnvTimeoutError(
            f"{what} {spec.name} did not finish within start_timeout={timeout:g}s: its "
            "constructor (or a step) hangs; the thread running it cannot be stopped and was "
            "abandoned, and no worker was started",
            env_index=None,
            phase=Phase.MAKE,
            worker=-1,
        ) from None


def build_probe(spec: EnvSpec) -> Any:
    try:
        return spec.build()
    except env_errors() as exc:
        failure = EnvFailure.capture(None, Phase.MAKE, exc)
        raise env_raised_error(
            f"building {spec.name} failed: {failure.type_name}: {failure.message}",
            exc,
            env_index=None,
            phase=Phase.MAKE,
            worker=-1,
        ) from exc


PROBE_CLOSE_TIMEOUT = 5.0


def close_probe(env: Any) -> None:
    """Close the probe env without letting a hanging ``close`` hang ``make``."""
    closer = threading.Thread(target=env.close, name="envfleet-probe-close", daemon=True)
    closer.start()
    closer.join(PROBE_CLOSE_TIMEOUT)
