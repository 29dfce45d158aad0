import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")  # tests never log in anywhere (the tutorial asks for log_with="wandb")


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """A quickly trained tiny base model (same builder, few steps): real files, loadable with from_pretrained."""
    from agentrl.jobs.base_model import build_base_model
    from agentrl.models.tiny import BaseModelConfig

    out = tmp_path_factory.mktemp("base") / "model"
    return str(build_base_model(out, BaseModelConfig(steps=40, batch_size=32, warmup_steps=5), progress=False))


@pytest.fixture(scope="session")
def embedded_base(tmp_path_factory):
    """The full-size embedded base model, as `make demo` builds it (about 100 s, once per session)."""
    from agentrl.jobs.base_model import build_base_model
    from agentrl.models.tiny import BaseModelConfig

    return str(build_base_model(tmp_path_factory.mktemp("embedded") / "model", BaseModelConfig(), progress=False))
