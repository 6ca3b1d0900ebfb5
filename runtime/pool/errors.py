"""The pool room's one error type."""


class PoolError(RuntimeError):
    """A model cannot be placed in the pool (larger than the pool, or the pool is held by other models'
    requests), or the pool was used wrongly (an unknown model, a model added twice). One line."""
