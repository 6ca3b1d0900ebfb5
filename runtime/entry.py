"""faas-bootstrap's entry point (the container's ENTRYPOINT): starts the restore of the CRIU snapshot the
bootstrap would restore first (snapshots/early_restore.py says why and what makes it safe), then, for a
process snapshot, the driver primer (snapshots/driver_primer.py), then the reading
into the page cache of the file pages a start from that snapshot touches (snapshots/start_pages.py) and then
of the weights (runtime/weights/prefetch.py), where they are not there, then imports the bootstrap and runs
it. From its first step SIGTERM and SIGINT wait until a restore is handed over or undone
(snapshots/stop_during_restore.py). `python -m runtime.bootstrap` runs the same start without any of them.

The image runs it without `site` (its `faas-bootstrap` is a script run by `python3 -S`; the bench starts
`python3 -S -m runtime.entry`): the interpreter starts without reading site-packages' `.pth` files and running
the start-up hooks they name (on the GPU machine a venv's hook made the interpreter's start 0.07-0.08 s instead of
0.01 s). Both starts need only the standard library and this package; `site` runs after them, and then the check
of the snapshot's image files begins (it hashes with xxhash, from site-packages), beside CRIU still restoring.
Started with `site` (the console script pip installs, `python -m runtime.entry`), the check begins right after
CRIU and the start is otherwise the same."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    starts = "-h" not in argv and "--help" not in argv
    if starts:
        import os

        from runtime.setting_text import FALSE_WORDS, early_flag, setting
        from snapshots import early_restore, stop_during_restore

        stop_during_restore.hold()  # until the restore is handed over or undone (runtime/bootstrap.py)
        kind = early_restore.start(argv, check=not sys.flags.no_site)
        if kind == "process" and early_flag(argv, os.environ, "PRIME_DRIVER") \
                and setting(argv, os.environ, "DEVICE") != "cpu":
            from snapshots import driver_primer

            driver_primer.start()
        pages = None
        if kind is not None and early_flag(argv, os.environ, "PREFETCH_START_PAGES"):
            from snapshots import start_pages

            pages = start_pages.start(os.path.expanduser(setting(argv, os.environ, "SNAPSHOT_DIR")), kind)
        if early_flag(argv, os.environ, "PREFETCH_WEIGHTS"):
            from runtime.weights import prefetch

            readers = prefetch.readers(setting(argv, os.environ, "PREFETCH_READERS"))
            during_restore = prefetch.readers(setting(argv, os.environ, "PREFETCH_RESTORE_READERS"),
                                              prefetch.RESTORE_READERS)
            # a process restore whose weights a helper streams leaves part of the embedding table for last
            helper = setting(argv, os.environ, "WEIGHTS_DURING_RESTORE")
            table_last = (kind == "process" and early_flag(argv, os.environ, "EMBEDDING_LAST")
                          and setting(argv, os.environ, "DEVICE") != "cpu"
                          and (helper is None or helper.strip().lower() not in FALSE_WORDS + ("never",)))
            table_readers = prefetch.readers(setting(argv, os.environ, "PREFETCH_TABLE_READERS"),
                                             prefetch.TABLE_READERS)
            prefetch.start(setting(argv, os.environ, "MODEL"), after=pages, readers=readers,
                           restore_readers=during_restore if kind is not None else None, embedding_last=table_last,
                           table_readers=table_readers)
    if sys.flags.no_site:
        import site

        site.main()
        if starts:
            early_restore.start_check()
    from runtime.bootstrap import main as bootstrap

    return bootstrap(argv)


if __name__ == "__main__":
    sys.exit(main())
