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


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's --dist loadgroup, the tests that share an expensive fixture go to one worker, which
    builds it once: those of the session's embedded base model, and each module's tests that use one of its
    module-scoped fixtures. The other tests are spread one by one."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if "embedded_base" in defs:
            item.add_marker(pytest.mark.xdist_group("embedded_base"))
        elif any(d.scope == "module" for fixtures in defs.values() for d in fixtures):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


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
