"""Every shipped accelerate launch config loads with accelerate's own loader and launcher checks, and says what
it promises (README "Scaling up"). DeepSpeed and FSDP cannot run on this CPU machine; their plugins are built
from the files, which is where accelerate validates their fields."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "agentrl" / "configs" / "accelerate"
# multi_cpu.yaml says MULTI_GPU: the type with which accelerate 1.16 starts its processes through torchrun (its
# MULTI_CPU starts one process without mpirun); agentrl joins them into a CPU group (see the file's comment).
EXPECTED = {"multi_cpu.yaml": DistributedType.MULTI_GPU, "ddp.yaml": DistributedType.MULTI_GPU,
            "fsdp.yaml": DistributedType.FSDP, "zero2.yaml": DistributedType.DEEPSPEED,
            "zero3.yaml": DistributedType.DEEPSPEED}


def test_the_shipped_set_and_the_path_of_the_readme():
    assert sorted(p.name for p in SHIPPED.glob("*.yaml")) == sorted(EXPECTED)
    # README commands say `--config_file configs/accelerate/<file>` from the repository root.
    assert (ROOT / "configs" / "accelerate" / "multi_cpu.yaml").resolve() == (SHIPPED / "multi_cpu.yaml").resolve()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_and_launch_accepts_it(name):
    config = load_config_from_file(str(SHIPPED / name))
    assert config.distributed_type == EXPECTED[name]
    assert config.num_processes == 2 and config.num_machines == 1 and config.mixed_precision == "no"
    args = launch_command_parser().parse_args(["--config_file", str(SHIPPED / name), "-m", "agentrl.cli", "ppo"])
    args = _validate_launch_command(args)[0]
    assert args.num_processes == 2 and not args.cpu  # args.cpu would send every one to the one-process launcher
    assert args.multi_gpu == (name in ("multi_cpu.yaml", "ddp.yaml"))  # the torchrun launcher
    assert args.use_fsdp == (name == "fsdp.yaml") and args.use_deepspeed == name.startswith("zero")


def test_fsdp_is_full_shard_with_transformer_layer_wrap(monkeypatch):
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(SHIPPED / "fsdp.yaml"), "-m", "agentrl.cli"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    for key, value in env.items():  # what `accelerate launch` hands the processes; the plugin reads it
        if key.startswith("FSDP_") or key == "ACCELERATE_USE_FSDP":
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.sharding_strategy.name == "FULL_SHARD"
    assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    assert plugin.state_dict_type.name == "FULL_STATE_DICT" and plugin.use_orig_params


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_configs(stage):
    ds = load_config_from_file(str(SHIPPED / f"zero{stage}.yaml")).deepspeed_config
    plugin = DeepSpeedPlugin(**{k: ds[k] for k in ("zero_stage", "gradient_accumulation_steps", "gradient_clipping",
                                                    "offload_optimizer_device", "offload_param_device")},
                             zero3_init_flag=ds.get("zero3_init_flag"), zero3_save_16bit_model=ds.get("zero3_save_16bit_model"))
    zero = plugin.deepspeed_config["zero_optimization"]
    assert zero["stage"] == stage and plugin.deepspeed_config["gradient_clipping"] == 1.0
    # Under ZeRO-3 agentrl saves weights gathered by accelerator.get_state_dict, which needs this flag.
    assert zero["stage3_gather_16bit_weights_on_model_save"] == (stage == 3)
