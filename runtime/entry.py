"""faas-bootstrap's entry point (the container's ENTRYPOINT): starts the restore of the CRIU snapshot the
bootstrap would restore first, then imports the bootstrap and runs it (snapshots/early_restore.py says why
and what makes it safe). `python -m runtime.bootstrap` runs the same start without the early restore."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" not in argv and "--help" not in argv:
        from snapshots import early_restore

        early_restore.start(argv)
    from runtime.bootstrap import main as bootstrap

    return bootstrap(argv)


if __name__ == "__main__":
    sys.exit(main())
