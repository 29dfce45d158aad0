import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")  # tests never log in anywhere (the tutorial asks for log_with="wandb")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs pytest -n auto: one intra-op thread a worker (and in the processes its tests start), since
    # two torch processes with a thread per core each slow each other several times over.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """A quickly trained tiny base model (same builder, few steps): real files, loadable with from_pretrained."""
    from agentrl.jobs.base_model import build_base_model
    from agentrl.models.tiny import BaseModelConfig

    out = tmp_path_factory.mktemp("base") / "model"
    return str(build_base_model(out, BaseModelConfig(steps=40, batch_size=32, warmup_steps=5), progress=False))


@pytest.fixture(scope="session")
def embedded_base(tmp_path_factory):
    """The full-size embedded base model, as `make demo` builds it (about 60-100 s, once per test run). Under
    pytest-xdist each worker has its own session: the first to get here builds it in the run's shared temporary
    directory, the others wait for it and read it (the tests only read it)."""
    from filelock import FileLock

    from agentrl.jobs.base_model import build_base_model
    from agentrl.models.tiny import BaseModelConfig

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the directory all workers' temporary directories share
    out = root / "embedded-shared" / "model"
    with FileLock(str(root / "embedded-shared.lock")):
        if not (out / "config.json").exists():
            build_base_model(out, BaseModelConfig(), progress=False)
    return str(out)
