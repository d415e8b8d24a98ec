"""Config: construction, DeepSpeed names, JSON, and a clear error for each bad value."""

from __future__ import annotations

import json

import pytest
import torch

from zpp_compile import Config, ConfigError


def test_defaults_and_dtype_names():
    config = Config(param_dtype="bf16", reduce_dtype="float32")
    assert config.param_dtype is torch.bfloat16 and config.reduce_dtype is torch.float32
    assert Config().hpz_partition_size == 0 and not Config().quantized_weights


def test_deepspeed_names_carry_over():
    config = Config.from_dict(
        {"zero_quantized_weights": True, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True}
    )
    assert config.quantized_weights and config.quantized_gradients and config.hpz_partition_size == 8
    # DeepSpeed's hpZ size 1 means "no secondary partition", which is 0 here.
    assert Config.from_dict({"zero_hpz_partition_size": 1}).hpz_partition_size == 0


def test_json_round_trip(tmp_path):
    path = tmp_path / "zeropp.json"
    config = Config(param_dtype="bf16", quantized_weights=True, inductor_options={"combo_kernels": True})
    path.write_text(json.dumps(config.to_dict()))
    assert Config.load(str(path)) == config
    assert dict(config.inductor_options) == {"combo_kernels": True}


@pytest.mark.parametrize(
    "values, message",
    [
        ({"quantized_wieghts": True}, "unknown config key 'quantized_wieghts'; did you mean 'quantized_weights'"),
        ({"gradient_bits": 2}, "Config.gradient_bits=2 is not supported; use 4 or 8"),
        ({"intra_node_gradient_bits": 16}, "Config.intra_node_gradient_bits=16 is not supported"),
        ({"weight_block_size": 100}, "Config.weight_block_size=100 must be a power of 2 between 32 and 65536"),
        ({"param_dtype": "int8"}, "Config.param_dtype='int8' is not a dtype"),
        ({"reduce_dtype": torch.int32}, "Config.reduce_dtype=torch.int32 is not supported"),
        ({"hpz_partition_size": -2}, "Config.hpz_partition_size=-2 must be 0"),
        ({"ranks_per_node": 0}, "Config.ranks_per_node=0 must be a positive integer"),
        ({"quantized_weights": "yes"}, "Config.quantized_weights='yes' must be True or False"),
        ({"collective_timeout_s": 0}, "Config.collective_timeout_s=0 must be a positive number"),
        ({"zero_quantized_weights": True, "quantized_weights": False}, "keep one"),
        ({"inductor_options": {"combo_kernel": True}},
         "Config.inductor_options: 'combo_kernel' is not a torch._inductor.config setting; did you mean 'combo_kernels'"),
        ({"inductor_options": 3}, "Config.inductor_options=3 must map Inductor setting names to values"),
        ({"cuda_graphs": True, "inductor": False}, "Config.cuda_graphs=True needs Inductor"),
        ({"bucket_size": "layers"}, "Config.bucket_size='layers' must be 'layer' or a number of bytes >= 0"),
    ],
)
def test_bad_values_name_key_value_and_range(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Config.from_dict(values)


def test_topology_checks():
    Config(hpz_partition_size=2).check_topology(world_size=4, ranks_per_node=2)
    with pytest.raises(ConfigError, match=r"hpz_partition_size=3 does not divide the world size 4; allowed: 0 \(off\) or one of \[1, 2, 4\]"):
        Config(hpz_partition_size=3).check_topology(world_size=4, ranks_per_node=2)
    with pytest.raises(ConfigError, match="ranks_per_node=3 does not divide the world size 4"):
        Config(ranks_per_node=3).check_topology(world_size=4, ranks_per_node=3)


def test_unreadable_json_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        Config.load(str(tmp_path / "missing.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        Config.load(str(tmp_path / "list.json"))
