import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before
# any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import make_engine, tiny_model_dir  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    criu_blockers = _criu_blockers() if any("criu" in item.keywords for item in items) else []
    skip_criu = pytest.mark.skip(reason=f"needs criu 4.x and root: {'; '.join(criu_blockers)}")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "criu" in item.keywords and criu_blockers:
            item.add_marker(skip_criu)


def _criu_blockers() -> list[str]:
    from snapshots.criu import find_criu, restore_blockers

    return restore_blockers(find_criu())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    made: dict[str, str] = {}

    def get(preset: str = "tiny-llama"):
        if preset not in made:
            made[preset] = tiny_model_dir(tmp_path_factory.mktemp(preset), preset)
        return made[preset]

    return get


@pytest.fixture
def engine_factory():
    engines = []

    def build(model_dir, **config):
        engine = make_engine(model_dir, **config)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.shutdown()
