"""Settings read as text before runtime/config.py is imported: the entry point (runtime/entry.py) acts on a
few of them before the bootstrap's imports, and reads them as the bootstrap's parse will. Imports nothing."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Mapping, Sequence

#: the defaults of the boolean settings the entry point reads before the bootstrap: runtime/config.py takes
#: them from here, so that the early read and the bootstrap's parse agree
EARLY_DEFAULTS = {"EARLY_RESTORE": True, "PREFETCH_WEIGHTS": True, "PREFETCH_START_PAGES": True, "LAZY_PAGES": False,
                  "CRIU_FEATURE_CACHE": True, "PRIME_DRIVER": True, "EMBEDDING_LAST": True}
#: the words a boolean setting is read as (runtime/config.py parses them the same way)
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


def setting(argv: Sequence[str], environ: Mapping[str, str], env: str) -> str | None:
    """A setting's text as runtime/config.py reads it: the environment, then its --flag (last one wins)."""
    flag = "--" + env.lower().replace("_", "-")
    value = environ.get(env)
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def early_flag(argv: Sequence[str], environ: Mapping[str, str], env: str) -> bool:
    """A boolean setting of EARLY_DEFAULTS, as the bootstrap will read it."""
    return true(setting(argv, environ, env), EARLY_DEFAULTS[env])


def true(text: str | None, default: bool) -> bool:
    """A boolean setting's text as runtime/config.py reads it; DEFAULT when unset or not a boolean (the
    bootstrap's parse then reports it)."""
    if text is None:
        return default
    value = text.strip().lower()
    return True if value in TRUE_WORDS else False if value in FALSE_WORDS else default
