"""Adapters that present an envfleet :class:`~envfleet.Pool` to other RL libraries.

Each adapter lives in its own submodule and imports its library only when imported itself:

- :mod:`envfleet.adapters.sb3`: Stable-Baselines3's ``VecEnv`` (``pip install 'envfleet[sb3]'``).
"""

__all__: list[str] = []  # the adapters are its submodules
