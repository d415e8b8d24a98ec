"""Config: construction, DeepSpeed names, JSON, a clear error for each bad value, and what
torch.compile's options may override."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from distributed import device, run_ranks

import zpp_compile as zpp
from zpp_compile import Config, ConfigError
from zpp_compile.reports.ledger import LEDGER


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
        ({"hpz_quantized_copy": 0}, "Config.hpz_quantized_copy=0 must be True or False"),
        ({"collective_timeout_s": 0}, "Config.collective_timeout_s=0 must be a positive number"),
        ({"zero_quantized_weights": True, "quantized_weights": False}, "keep one"),
        ({"inductor_options": {"combo_kernel": True}},
         "Config.inductor_options: 'combo_kernel' is not a torch._inductor.config setting; "
         "did you mean 'combo_kernels'"),
        ({"inductor_options": 3}, "Config.inductor_options=3 must map Inductor setting names to values"),
        ({"cuda_graphs": True, "inductor": False}, "Config.cuda_graphs=True needs Inductor"),
        ({"bucket_size": "layers"}, "Config.bucket_size='layers' must be 'layer' or a number of bytes >= 0"),
        ({"collective_timeout_s": float("nan")}, "Config.collective_timeout_s=nan must be a positive number"),
        ({"collective_timeout_s": float("inf")}, "Config.collective_timeout_s=inf must be a positive number"),
        ({"collective_timeout_s": True}, "Config.collective_timeout_s=True must be a positive number"),
        ({"gradient_bits": 4.0}, "Config.gradient_bits=4.0 is not supported; use 4 or 8"),
        ({"disable_passes": 5}, "Config.disable_passes=5 must be a list of pass names"),
        ({"disable_passes": ["quantise_weights"]},
         "Config.disable_passes (or ZEROPP_DISABLE_PASSES) names unknown passes"),
        ({1: True}, "config keys must be strings, got 1"),
    ],
)
def test_bad_values_name_key_value_and_range(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Config.from_dict(values)


def test_constructor_and_from_dict_reject_what_is_not_a_config():
    with pytest.raises(ConfigError, match="unknown config key 'bogus'; known keys: "):
        Config(bogus=1)
    with pytest.raises(ConfigError, match="unknown config key 'quantized_weight'; did you mean 'quantized_weights'"):
        Config(quantized_weight=True)
    with pytest.raises(ConfigError, match="'zero_quantized_weights' is DeepSpeed's name for 'quantized_weights'"):
        Config(zero_quantized_weights=True)
    with pytest.raises(ConfigError, match="a config must be a dict of settings, got list"):
        Config.from_dict([("quantized_weights", True)])
    with pytest.raises(ConfigError, match="names unknown passes"):  # at construction, not at the first compile
        Config().updated({"disable_passes": ["bucketing"]})
    assert Config(disable_passes="schedule_overlap").disable_passes == ("schedule_overlap",)


def test_topology_checks():
    Config(hpz_partition_size=2).check_topology(world_size=4, ranks_per_node=2)
    with pytest.raises(ConfigError, match=r"hpz_partition_size=3 does not divide the world size 4; "
                                          r"allowed: 0 \(off\) or one of \[1, 2, 4\]"):
        Config(hpz_partition_size=3).check_topology(world_size=4, ranks_per_node=2)
    with pytest.raises(ConfigError, match="ranks_per_node=3 does not divide the world size 4"):
        Config(ranks_per_node=3).check_topology(world_size=4, ranks_per_node=3)


def test_unreadable_json_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        Config.load(str(tmp_path / "missing.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        Config.load(str(tmp_path / "list.json"))
    (tmp_path / "binary.json").write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match="is not a JSON text file"):
        Config.load(tmp_path / "binary.json")


SHARDED_WITH = {"ranks_per_node": 1, "collective_timeout_s": 30.0}


def compiled_step(model: nn.Module, options: dict, x: torch.Tensor) -> torch.Tensor:
    """One compiled forward and backward with `options`; returns the loss."""
    torch._dynamo.reset()
    loss = torch.compile(model, backend="zeropp", options={"inductor": False, **options})(x).square().mean()
    loss.backward()
    return loss.detach()


def compile_options(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 64, device=device())
    model = zpp.shard(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(device()), SHARDED_WITH)
    # Each field shard() acts on is rejected at the first call when it differs from the model's
    # value, with a message naming it and saying where it belongs.
    for key, value in [("param_dtype", "bf16"), ("reduce_dtype", torch.bfloat16), ("ranks_per_node", 2),
                       ("collective_timeout_s", 5.0), ("hpz_partition_size", 2)]:
        with pytest.raises(Exception, match=rf"ConfigError: .*sets {key}=.*but the model was sharded with {key}=.*"
                                            rf"pass it to zpp_compile.shard\(model, Config\(...\)\) instead"):
            compiled_step(model, {key: value}, x)
    # The same values as the model's are accepted (dtype names and DeepSpeed's names included).
    same = {"param_dtype": None, "reduce_dtype": "fp32", "ranks_per_node": 1, "collective_timeout_s": 30,
            "zero_hpz_partition_size": 1}
    eager = model(x).square().mean()
    assert torch.equal(compiled_step(model, same, x), eager)

    # A compile-time field given as an option does what it does given to shard(): qgZ's
    # collectives and gradients, bit for bit.
    results = []
    for shard_config, options in [({**SHARDED_WITH, "quantized_gradients": True}, {}),
                                  (SHARDED_WITH, {"quantized_gradients": True})]:
        torch.manual_seed(0)
        model = zpp.shard(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(device()), shard_config)
        LEDGER.clear()
        compiled_step(model, options, x)
        report = zpp.comm_report().to_dict()
        for row in report["collectives"]:
            row.pop("graph")  # numbered in compile order
        results.append((report, [p.grad.full_tensor() for p in model.parameters()]))
    (report_a, grads_a), (report_b, grads_b) = results
    assert "uint8" in {c["dtype"] for c in report_b["collectives"] if c["phase"] == "gradient reduction"}
    assert report_a == report_b and report_b["inter_bytes"] > 0
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


@pytest.mark.distributed
def test_compile_options_override_compile_fields_and_reject_shard_fields():
    run_ranks(compile_options, 2)


def test_a_misspelled_deepspeed_switch_says_which_was_meant():
    for typo, meant in [("zero_quantized_weight", "zero_quantized_weights"),
                        ("zero_hpz_partition_sise", "zero_hpz_partition_size"),
                        ("zero_quantize_gradients", "zero_quantized_gradients")]:
        with pytest.raises(ConfigError, match=rf"zero_optimization\.{typo} is no DeepSpeed setting; did you mean "
                                              rf"'{meant}'\? As written it would be ignored"):
            Config.from_dict({"zero_optimization": {"stage": 3, typo: True}})
    # DeepSpeed's own keys near them are no typos: named among the ignored ones, as before.
    with pytest.warns(UserWarning, match=r"no use for zero_optimization\.zero_quantized_nontrainable_weights"):
        config = Config.from_dict({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                         "zero_quantized_nontrainable_weights": True}})
    assert config.quantized_weights
