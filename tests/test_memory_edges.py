"""hardy.plan.memory's model states at their edges: bytes per parameter for each precision and
master-weights setting, the ZeRO formulas worked by hand (with no host bytes unless offloading), and
the one-line refusals of bad stages and offload modes. Numbers come from the module docstring and
docs/planner.md's memory section (Rajbhandari et al. 2020), not from the code's output."""
from __future__ import annotations

import re

import pytest

from hardy.errors import HardyError
from hardy.plan.memory import model_state_bytes, state_bytes

PSI = 1e9  # parameters on this model-parallel rank
GB = 1e9


def test_master_weights_are_kept_unless_asked_otherwise():
    # mixed-precision Adam by default: 16-bit weights and gradients, 12 B of fp32 master, m and v
    assert state_bytes("bf16") == (2, 2, 12)
    assert state_bytes("fp16") == (2, 2, 12)


def test_pure_16_bit_run_keeps_weights_grads_and_moments_in_16_bits():
    # without master weights: 2 + 2 + (m, v at 2 each) = 2, 2, 4 (KempnerForge's pure bf16)
    assert state_bytes("bf16", master_weights=False) == (2, 2, 4)
    assert state_bytes("fp16", master_weights=False) == (2, 2, 4)


@pytest.mark.parametrize("master_weights", [True, False])
def test_fp32_adam_is_4_4_8_whatever_the_master_weights_flag(master_weights):
    # the flag concerns 16-bit runs only: fp32 weights are their own master copy, m and v 4 B each
    assert state_bytes("fp32", master_weights=master_weights) == (4, 4, 8)
    states = model_state_bytes(PSI, 0, 8, "fp32", master_weights=master_weights)
    assert (states["weights"], states["gradients"], states["optimizer"]) == (4 * GB, 4 * GB, 8 * GB)


# bf16 mixed precision (w, g, o = 2, 2, 12), Ψ = 1e9, d = 8, by hand from the ZeRO table:
# ZeRO-0 all replicated; ZeRO-1 o·Ψ/d; ZeRO-2 (g + o)·Ψ/d; ZeRO-3 (w + g + o)·Ψ/d
@pytest.mark.parametrize("zero, weights, grads, optim", [
    (0, 2.0, 2.0, 12.0),
    (1, 2.0, 2.0, 1.5),
    (2, 2.0, 0.25, 1.5),
    (3, 0.25, 0.25, 1.5),
])
def test_zero_stages_shard_states_and_leave_nothing_on_the_host(zero, weights, grads, optim):
    states = model_state_bytes(PSI, zero, 8, "bf16")
    assert states == {"weights": weights * GB, "gradients": grads * GB, "optimizer": optim * GB,
                      "host": 0.0}  # no offload: not a byte of host memory


def test_optimizer_offload_puts_exactly_the_optimizer_and_gradients_on_the_host():
    # fp32, ZeRO-1, d = 4: the host holds this rank's partitions, optimizer 8 GB / 4 and fp32 gradients
    # 4 GB / 4 (DeepSpeed's offloading optimizer partitions them at stage 1 as at stage 2)
    states = model_state_bytes(PSI, 1, 4, "fp32", offload="optimizer")
    assert states == {"weights": 4 * GB, "gradients": 0.0, "optimizer": 0.0, "host": 3 * GB}
    # bf16 with master weights: the host's gradient copy is fp32 (4 B), not the run's 2; without master
    # weights it stays 16-bit
    assert model_state_bytes(PSI, 2, 4, "bf16", offload="optimizer")["host"] == pytest.approx((12 + 4) * GB / 4)
    assert model_state_bytes(PSI, 2, 4, "bf16", offload="optimizer", master_weights=False)["host"] == \
        pytest.approx((4 + 2) * GB / 4)


def test_parameter_offload_puts_every_zero3_shard_on_the_host():
    # fp32, ZeRO-3, d = 4: (4 + 4 + 8)·Ψ/4 = 4 GB, all of it in host memory
    states = model_state_bytes(PSI, 3, 4, "fp32", offload="params")
    assert states == {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "host": 4 * GB}


def _refusal(**kw) -> str:
    args = dict(params=PSI, zero=1, dp=8, precision="bf16")
    with pytest.raises(HardyError) as caught:
        model_state_bytes(**{**args, **kw})
    message = str(caught.value)
    assert message and "\n" not in message  # the CLI reports bad input as one line
    return message


@pytest.mark.parametrize("zero", [-1, 5])
def test_bad_zero_stage_is_refused_naming_the_stage_given(zero):
    message = _refusal(zero=zero)
    # the user must learn which setting is wrong and what they passed
    assert "ZeRO" in message and re.search(rf"(?<![\d-]){zero}(?!\d)", message)


def test_bad_offload_mode_is_refused_naming_it_and_the_choices():
    message = _refusal(offload="disk")
    assert "disk" in message
    assert all(choice in message for choice in ("none", "optimizer", "params"))


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_parameter_offload_below_zero3_is_refused_pointing_at_zero3(zero):
    assert "--zero 3" in _refusal(zero=zero, offload="params")
