import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# No test touches the network, W&B included: where wandb is installed, `log_with="wandb"` runs offline and
# writes under a temporary directory unless the job names one.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DIR", tempfile.mkdtemp(prefix="agentrl-wandb-"))


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """A quickly trained tiny base model (same builder, few steps): real files, loadable with from_pretrained."""
    from agentrl.models.tiny import BaseModelConfig, build_base_model

    out = tmp_path_factory.mktemp("base") / "model"
    return str(build_base_model(out, BaseModelConfig(steps=40, batch_size=32, warmup_steps=5), progress=False))


@pytest.fixture(scope="session")
def embedded_base(tmp_path_factory):
    """The full-size embedded base model, as `make demo` builds it (about 100 s, once per session)."""
    from agentrl.models.tiny import BaseModelConfig, build_base_model

    return str(build_base_model(tmp_path_factory.mktemp("embedded") / "model", BaseModelConfig(), progress=False))
