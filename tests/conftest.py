import pytest
import torch

from angel_ptm.io import create_engine, native_available

ENGINE_BACKENDS = ["native", "python"] if native_available() else ["python"]


@pytest.fixture(params=ENGINE_BACKENDS)
def io_engine(request):
    engine = create_engine(threads=4, queue_depth=32, chunk_bytes=1 << 20, backend=request.param)
    yield engine
    engine.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
