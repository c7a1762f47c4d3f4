"""envfleet: run many copies of any Gymnasium environment in parallel, behind one VectorEnv."""

from gymnasium.vector import AutoresetMode

from envfleet._make import make
from envfleet.backends import Backend
from envfleet.errors import (
    AlreadyPendingError,
    BrokenPoolError,
    ClosedPoolError,
    EnvError,
    EnvRaisedError,
    EnvTimeoutError,
    NoPendingError,
    OnError,
    Phase,
    PoolStateError,
    RemoteError,
    RemoteTraceback,
    RestartLimitError,
    WorkerDiedError,
)
from envfleet.pool import Pool
from envfleet.spec import EnvSpec

__version__ = "0.1.0"

__all__ = [
    "AlreadyPendingError",
    "AutoresetMode",
    "Backend",
    "BrokenPoolError",
    "ClosedPoolError",
    "EnvError",
    "EnvRaisedError",
    "EnvSpec",
    "EnvTimeoutError",
    "NoPendingError",
    "OnError",
    "Phase",
    "Pool",
    "PoolStateError",
    "RemoteError",
    "RemoteTraceback",
    "RestartLimitError",
    "WorkerDiedError",
    "__version__",
    "make",
]
