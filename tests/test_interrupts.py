"""SIGTERM stops a command-line tool through its clean-up (runtime/interrupts.py), run as a real process."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# The main thread spends most of its time where CPython drops what is raised, a finalizer or a weakref's callback
# (as the import system's module locks have): a KeyboardInterrupt raised there would be printed and dropped, and
# the loop would run on.
SCRIPT = textwrap.dedent("""
    import sys, time, weakref
    from runtime.interrupts import sigterm_interrupts_main

    class Slow:
        def __del__(self):
            time.sleep(0.04)

    class Plain:
        pass

    def slow_callback(ref):
        time.sleep(0.04)

    if "poke-in-hook" in sys.argv:  # the watcher's poke lands while the hook takes an interrupt back
        import os, signal
        write = os.write

        def write_poked(fd, data):
            if sys._getframe(1).f_code.co_name == "take_back":
                print("poked in the hook", file=sys.stderr, flush=True)
                signal.raise_signal(signal.SIGUSR1)
            return write(fd, data)

        os.write = write_poked

    with sigterm_interrupts_main():
        print("ready", flush=True)
        try:
            if sys.argv[1] == "dropped-once":  # as C code that clears every error would drop it, unreported
                try:
                    time.sleep(30)
                except KeyboardInterrupt:
                    pass
                print("went on", flush=True)
                time.sleep(30)
            while True:
                if sys.argv[1] == "finalizer":
                    Slow()
                else:
                    ref = weakref.ref(Plain(), slow_callback)
                time.sleep(0.004)
        except KeyboardInterrupt:
            print("cleaned up", flush=True)
            sys.exit(130)
""")


def interrupt_once(where: str, *flags: str) -> tuple[int | None, str, str]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, where, *flags], cwd=Path(__file__).parent.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


@pytest.mark.parametrize("where", ["finalizer", "weakref-callback"])
def test_sigterm_interrupts_a_main_thread_busy_where_exceptions_are_dropped(where):
    for _ in range(4):  # the signal lands there most times, not every time
        status, out, err = interrupt_once(where)
        assert status == 130 and out.strip() == "cleaned up", f"status {status}: {err[-2000:]}"
        assert "Exception ignored" not in err


def test_a_poke_that_lands_while_the_hook_takes_an_interrupt_back_is_not_lost():
    """Raised inside the hook, an interrupt is dropped for good: the tool would run on after SIGTERM."""
    poked = 0
    for _ in range(4):
        status, out, err = interrupt_once("weakref-callback", "poke-in-hook")
        assert status == 130 and out.strip() == "cleaned up", f"status {status}: {err[-2000:]}"
        poked += "poked in the hook" in err
    assert poked  # the hook took an interrupt back at least once, with a poke inside it


def test_an_interrupt_dropped_without_a_report_is_asked_for_again():
    """Dropped where nothing reports it, the interrupt would leave the tool running after SIGTERM."""
    status, out, err = interrupt_once("dropped-once")
    assert status == 130 and out.split() == ["went", "on", "cleaned", "up"], f"status {status}: {err[-2000:]}"
