import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from treadle.engine.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
