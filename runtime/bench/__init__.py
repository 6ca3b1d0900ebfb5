"""faas-bench: where a cold start goes, what each restore path buys, and how it shows under load.

`coldstart` starts one fresh server per mode, the way a container starts, and times spawn -> first token
with the server's own stage timeline; `trace` replays Poisson arrivals against a pool of instances that a
scaler starts (real cold starts) and retires. Everything talks to the server over HTTP only (/health and
/v1/completions), so the bench works whatever restore paths this build has.
"""


class BenchError(Exception):
    """The benchmark cannot run as asked (bad input, a server that never came up). One-line message."""
