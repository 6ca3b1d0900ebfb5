"""faas-bootstrap's entry point (the container's ENTRYPOINT): starts the restore of the CRIU snapshot the
bootstrap would restore first (snapshots/early_restore.py says why and what makes it safe), then the reading
of the weights into the page cache where they are not there (runtime/weights/prefetch.py), then imports the
bootstrap and runs it. `python -m runtime.bootstrap` runs the same start without either."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" not in argv and "--help" not in argv:
        import os

        from runtime.setting_text import early_flag, setting
        from snapshots import early_restore

        early_restore.start(argv)
        if early_flag(argv, os.environ, "PREFETCH_WEIGHTS"):
            from runtime.weights import prefetch

            prefetch.start(setting(argv, os.environ, "MODEL"))
    from runtime.bootstrap import main as bootstrap

    return bootstrap(argv)


if __name__ == "__main__":
    sys.exit(main())
