"""The one error type of runtime/weights: a model that cannot be built, found or loaded, with a one-line reason."""


class WeightsError(RuntimeError):
    pass
