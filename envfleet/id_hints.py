"""What to tell someone whose env id is not registered: the nearest registered ids, and the
extra to install only when the id belongs to that extra's package.

An extra is named only on evidence: an ``ALE/...`` id, or one of the old Atari ids
(``Pong-v0``, ``BreakoutNoFrameskip-v4``: a game of :data:`ATARI_GAMES`), needs ale-py
(``envfleet[atari]``); a ``module:Env-v0`` id whose module cannot import the legacy ``gym``
(or Shimmy) needs ``envfleet[legacy]``. A mistyped id gets the registered ids closest to it,
never an install line.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import re
from collections.abc import Iterable

import gymnasium

ATARI_GAMES = frozenset(
    {
        "Adventure",
        "AirRaid",
        "Alien",
        "Amidar",
        "Assault",
        "Asterix",
        "Asteroids",
        "Atlantis",
        "BankHeist",
        "BattleZone",
        "BeamRider",
        "Berzerk",
        "Bowling",
        "Boxing",
        "Breakout",
        "Carnival",
        "Centipede",
        "ChopperCommand",
        "CrazyClimber",
        "Defender",
        "DemonAttack",
        "DoubleDunk",
        "ElevatorAction",
        "Enduro",
        "FishingDerby",
        "Freeway",
        "Frostbite",
        "Gopher",
        "Gravitar",
        "Hero",
        "IceHockey",
        "Jamesbond",
        "JourneyEscape",
        "Kangaroo",
        "Krull",
        "KungFuMaster",
        "MontezumaRevenge",
        "MsPacman",
        "NameThisGame",
        "Phoenix",
        "Pitfall",
        "Pong",
        "Pooyan",
        "PrivateEye",
        "Qbert",
        "Riverraid",
        "RoadRunner",
        "Robotank",
        "Seaquest",
        "Skiing",
        "Solaris",
        "SpaceInvaders",
        "StarGunner",
        "Tennis",
        "TimePilot",
        "Tutankham",
        "UpNDown",
        "Venture",
        "VideoPinball",
        "WizardOfWor",
        "YarsRevenge",
        "Zaxxon",
    }
)
"""The games whose old ids (``Pong-v0``, ``Pong-v4``, ``PongNoFrameskip-v4``,
``Pong-ramDeterministic-v4``...) ale-py registers besides ``ALE/...``."""

_OLD_ATARI_ID = re.compile(r"^(?P<game>[A-Za-z]+?)(-ram)?(Deterministic|NoFrameskip)?-v[04]$")

EXTRA_PACKAGES = {"atari": ("ale_py",), "legacy": ("gym", "shimmy")}
"""Which import names each extra provides (``pip install 'envfleet[EXTRA]'``)."""

MAX_SUGGESTIONS = 3
SIMILARITY = 0.75
"""How alike (``difflib`` ratio) a registered id must be to be suggested."""
MARGIN = 0.05
"""A suggestion is at most this much less alike than the closest one."""


def is_atari_id(env_id: str) -> bool:
    """Whether ``env_id`` is an id ale-py registers: ``ALE/...`` or an old Atari game's id."""
    if env_id.startswith("ALE/"):
        return True
    match = _OLD_ATARI_ID.match(env_id)
    return match is not None and match.group("game") in ATARI_GAMES


def extra_for(env_id: str) -> str | None:
    """The extra to install for ``env_id``, when the id belongs to one that is missing."""
    module_name, sep, bare_id = env_id.rpartition(":")
    if sep:
        missing = _missing_import(module_name)
        for extra, packages in EXTRA_PACKAGES.items():
            if missing in packages:
                return extra
    if is_atari_id(bare_id) and importlib.util.find_spec("ale_py") is None:
        return "atari"
    return None


def _missing_import(module_name: str) -> str | None:
    """The top-level package whose absence stops ``module_name`` from importing, if any."""
    try:
        importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        return (exc.name or "").split(".")[0] or None
    except Exception:
        return None
    return None


def nearest_ids(env_id: str, registered: Iterable[str] | None = None) -> list[str]:
    """The registered ids nearest to ``env_id``, closest first, compared without case: those
    at least :data:`SIMILARITY` alike and nearly as alike as the closest one (at most
    :data:`MAX_SUGGESTIONS`); ``[]`` when none is close."""
    ids = list(gymnasium.registry if registered is None else registered)
    bare = env_id.rpartition(":")[2].lower()
    by_lower: dict[str, str] = {}
    for known in ids:
        by_lower.setdefault(known.lower(), known)
    matcher = difflib.SequenceMatcher(b=bare)
    scored = []
    for lower in by_lower:
        matcher.set_seq1(lower)
        if matcher.real_quick_ratio() >= SIMILARITY and matcher.quick_ratio() >= SIMILARITY:
            ratio = matcher.ratio()
            if ratio >= SIMILARITY:
                scored.append((ratio, lower))
    if not scored:
        return []
    scored.sort(key=lambda pair: (-pair[0], pair[1]))
    best = scored[0][0]
    return [by_lower[lower] for ratio, lower in scored[:MAX_SUGGESTIONS] if ratio >= best - MARGIN]


def unknown_id_message(env_id: str) -> str:
    """``unknown environment id 'X'`` and what may help: the extra it needs; else the nearest
    registered ids, and for a ``module:Env-v0`` id why its module did not import."""
    message = f"unknown environment id {env_id!r}"
    extra = extra_for(env_id)
    if extra == "atari":
        return f"{message}: Atari ids need ale-py: pip install 'envfleet[atari]'"
    if extra == "legacy":
        return (
            f"{message}: its module needs the legacy gym (and Shimmy, to convert its envs): "
            "pip install 'envfleet[legacy]'"
        )
    suggestions = nearest_ids(env_id)
    if suggestions:
        message += f"; did you mean {' or '.join(repr(s) for s in suggestions)}?"
    else:
        message += ": no registered id is close to it"
    module_name, sep, _ = env_id.rpartition(":")
    if sep:
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            message += f"; importing {module_name!r} failed: {exc}"
    return message


__all__ = [
    "ATARI_GAMES",
    "EXTRA_PACKAGES",
    "MARGIN",
    "MAX_SUGGESTIONS",
    "SIMILARITY",
    "extra_for",
    "is_atari_id",
    "nearest_ids",
    "unknown_id_message",
]
