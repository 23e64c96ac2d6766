"""Range checks on a hardware catalogue's numbers and on the model-state sizes: a bad value in a user's
catalogue (an efficiency given in percent, a zero bandwidth, a fractional node) or an unknown precision is
one HardyError line naming the field, never a silent plan, a KeyError or a division by zero."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys

import pytest

from conftest import hardy_main
from hardy.errors import HardyError
from hardy.plan.arch import load_arch
from hardy.plan.hardware import CATALOGUE, get_hardware, load_catalogue
from hardy.plan.memory import STATE_BYTES, model_state_bytes, state_bytes
from hardy.plan.train import TrainJob, plan_train

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SHIPPED = tomllib.loads(CATALOGUE.read_text())
REFERENCE = SHIPPED["layer_gemm"]["reference"]  # a100-80g: the entry the others' GEMM efficiency derives from


# --- a catalogue written back from the shipped one's dict -------------------------------------------------

def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON's escapes are TOML basic-string escapes
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {v!r}")


def dump(data: dict) -> str:
    """TOML for the catalogue's shape: [layer_gemm] and one [hardware.NAME] table per entry (nested tables
    inline)."""
    lines = []
    for top, table in data.items():
        if top == "hardware":
            for name, entry in table.items():
                lines.append(f"[hardware.{_key(name)}]")
                lines += [f"{_key(k)} = {_value(v)}" for k, v in entry.items()]
        else:
            lines.append(f"[{_key(top)}]")
            lines += [f"{_key(k)} = {_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def catalogue_with(tmp_path, entry: str, path: tuple[str, ...], value, whole: bool = False):
    """A catalogue file holding the shipped `entry` (and the [layer_gemm] reference it may derive from, or
    every entry with `whole`) with the field at `path` set to `value`."""
    data = json.loads(json.dumps(SHIPPED))  # a deep copy (the catalogue holds only JSON types)
    names = list(data["hardware"]) if whole else list(dict.fromkeys([REFERENCE, entry]))
    data["hardware"] = {n: data["hardware"][n] for n in names}
    table = data["hardware"][entry]
    for key in path[:-1]:
        table = table[key]
    table[path[-1]] = value
    file = tmp_path / "catalogue.toml"
    file.write_text(dump(data))
    return file


def test_the_test_writer_round_trips_the_shipped_catalogue(tmp_path):
    file = tmp_path / "same.toml"
    file.write_text(dump(SHIPPED))
    assert load_catalogue(file) == load_catalogue()


def test_every_shipped_entry_loads_alone_and_has_its_numbers_in_range(tmp_path):
    shipped = load_catalogue()
    assert set(shipped) == set(SHIPPED["hardware"])
    for name, hw in shipped.items():
        alone = tmp_path / f"{name}.toml"
        alone.write_text(dump({"layer_gemm": SHIPPED["layer_gemm"],
                               "hardware": {n: SHIPPED["hardware"][n] for n in dict.fromkeys([REFERENCE, name])}}))
        assert load_catalogue(alone)[name] == hw
        fractions = [hw.flops_efficiency, hw.bandwidth_efficiency, hw.intra_node.efficiency, hw.inter_node.efficiency]
        fractions += [f for f in (hw.best_gemm_efficiency, hw.best_gemm_efficiency_fp8, hw.attention_efficiency)
                      if f is not None]
        assert all(0 < f <= 1 for f in fractions), name
        assert min(hw.peak_flops.values()) > 0 and hw.memory_bytes > 0 and hw.memory_bandwidth > 0, name
        assert hw.intra_node.bandwidth > 0 and hw.inter_node.bandwidth > 0 and hw.devices_per_node >= 1, name


FRACTIONS = [("flops_efficiency",), ("bandwidth_efficiency",), ("best_gemm_efficiency",),
             ("best_gemm_efficiency_fp8",), ("attention_efficiency",), ("intra_node", "efficiency"),
             ("inter_node", "efficiency")]
BAD_FRACTIONS = [0.0, -0.5, 1.5, 90.0, math.nan, "0.9", True]


def _raises_naming(file, entry: str, field: str):
    with pytest.raises(HardyError) as e:
        load_catalogue(file)
    message = str(e.value)
    assert field in message and f"[{entry}]" in message and str(file) in message, message
    assert "\n" not in message
    return message


# a100-80g gives its own GEMM efficiency and is the [layer_gemm] reference; h100-sxm's is derived from it
@pytest.mark.parametrize("entry", ["a100-80g", "h100-sxm"])
@pytest.mark.parametrize("path", FRACTIONS, ids=".".join)
@pytest.mark.parametrize("bad", BAD_FRACTIONS, ids=repr)
def test_an_efficiency_outside_0_1_or_not_a_number_is_one_line_naming_the_field(tmp_path, entry, path, bad):
    field = ".".join(path)
    message = _raises_naming(catalogue_with(tmp_path, entry, path, bad), entry, field)
    if isinstance(bad, float):
        assert f"{field} must be in (0, 1], got {bad}" in message
    else:
        assert f"{field} must be a number in (0, 1], got {bad!r}" in message


def test_an_efficiency_of_exactly_1_or_an_integer_is_accepted(tmp_path):
    for path in FRACTIONS:
        hw = load_catalogue(catalogue_with(tmp_path, "h100-sxm", path, 1))["h100-sxm"]
        table = hw
        for key in path:
            table = getattr(table, key)
        assert table == 1.0


POSITIVES = [("peak_tflops", "bf16"), ("peak_tflops", "fp32"), ("memory_gb",), ("bandwidth_gbs",),
             ("intra_node", "bandwidth_gbs"), ("inter_node", "bandwidth_gbs")]


@pytest.mark.parametrize("path", POSITIVES, ids=".".join)
@pytest.mark.parametrize("bad", [0.0, 0, -80.0, math.inf, math.nan, "80", False], ids=repr)
def test_a_non_positive_peak_size_or_bandwidth_is_one_line_naming_the_field(tmp_path, path, bad):
    field = ".".join(path)
    message = _raises_naming(catalogue_with(tmp_path, "h100-sxm", path, bad), "h100-sxm", field)
    assert f"{field} must be a positive number, got" in message


@pytest.mark.parametrize("bad", [0, -8, 8.5, 8.0, "8", True], ids=repr)
def test_devices_per_node_below_1_or_not_whole_is_one_line_naming_the_field(tmp_path, bad):
    message = _raises_naming(catalogue_with(tmp_path, "h100-sxm", ("devices_per_node",), bad),
                             "h100-sxm", "devices_per_node")
    assert f"devices_per_node must be a whole number >= 1, got {bad!r}" in message


def test_a_bad_efficiency_in_a_user_catalogue_is_exit_2_and_one_line_from_the_cli(tmp_path):
    file = catalogue_with(tmp_path, "h100-sxm", ("intra_node", "efficiency"), 80.0, whole=True)  # percent
    result = hardy_main("plan", "train", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--devices", "8",
                        "--catalogue", str(file))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("hardy: error: "), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert "[h100-sxm]" in result.stderr and "intra_node.efficiency must be in (0, 1], got 80.0" in result.stderr
    # the same file with the efficiency fixed plans
    good = catalogue_with(tmp_path, "h100-sxm", ("intra_node", "efficiency"), 0.8, whole=True)
    assert hardy_main("plan", "train", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--devices", "8",
                      "--catalogue", str(good)).returncode == 0


# --- model-state sizes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("master_weights", [True, False])
@pytest.mark.parametrize("precision", ["fp8", "int8", "BF16", ""])
def test_state_bytes_of_an_unknown_precision_is_a_hardy_error_naming_it_and_the_known_ones(precision,
                                                                                            master_weights):
    with pytest.raises(HardyError) as e:
        state_bytes(precision, master_weights)
    message = str(e.value)
    assert repr(precision) in message and all(known in message for known in STATE_BYTES), message
    assert "(known: fp32, bf16, fp16; fp8 training keeps bf16 states)" in message, message
    with pytest.raises(HardyError):
        model_state_bytes(1e9, 3, 8, precision, master_weights=master_weights)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_parameter_offload_below_zero_3_is_refused_in_exactly_one_sentence(zero):
    with pytest.raises(HardyError) as e:
        model_state_bytes(1e9, zero, 8, offload="params")
    assert str(e.value) == "parameter offload needs ZeRO-3 / FSDP full sharding (--zero 3)"


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [0, -1, -8])
def test_model_states_sharded_over_fewer_than_one_rank_are_a_hardy_error(zero, dp):
    with pytest.raises(HardyError, match=rf"dp >= 1 .*got dp={dp}"):
        model_state_bytes(1e9, zero, dp)
    assert model_state_bytes(1e9, zero, 1)["weights"] == 2e9  # one rank: nothing sharded


def test_fp8_training_keeps_bf16_model_states():
    """`plan train --fp8` runs the linears in fp8 inside a bf16 model: its callers size the states as bf16."""
    base = dict(arch=load_arch("llama3.1-8b"), hw=get_hardware("h100-sxm"), devices=8, seq=4096,
                global_batch_tokens=8 * 4096 * 4, zero=3)
    bf16, fp8 = plan_train(TrainJob(**base)), plan_train(TrainJob(**base, fp8="rowwise"))
    for part in ("weights", "gradients", "optimizer"):
        assert fp8.memory[part] == bf16.memory[part] > 0
    with pytest.raises(HardyError, match="precision must be fp32, bf16 or fp16"):
        plan_train(dataclasses.replace(TrainJob(**base), precision="fp8"))
